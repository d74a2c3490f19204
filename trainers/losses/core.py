"""The translation losses (caption embedding -> image embedding): ranking, slot, InfoNCE and alignment terms.

Each is a registered `Loss` module (latentsweep.trainers.losses.base) built from its `cfg.loss.<name>` section; the
queue loss
lives in trainers/losses/queue.py and the multi-label triplet in trainers/losses/multilabel.py.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from latentsweep.trainers.losses.base import Loss, masked_ce, multipos_i2c, register_loss, same_image, unit, zero_like


def _vse_hinge(sim: torch.Tensor, neg: torch.Tensor, margin: float, hardest: bool) -> tuple[torch.Tensor, ...]:
    """VSE++ hinge both ways. sim [B, B]: caption i vs the image of caption j, positives on the diagonal;
    neg [B, B] bool marks true negatives. Returns (caption->image, image->caption) averaged over the batch."""
    pos = sim.diagonal()
    if hardest:
        # The hinge is monotone in sim, so the hardest violation is the hinge of the hardest negative: two [B, B]
        # reductions instead of hinges over the whole matrix (same value and gradient; no negative -> 0).
        hard = sim.masked_fill(~neg, -torch.inf)
        c2i = (margin + hard.max(dim=1).values - pos).clamp(min=0)
        i2c = (margin + hard.max(dim=0).values - pos).clamp(min=0)
        return c2i.mean(), i2c.mean()
    c2i = (margin + sim - pos[:, None]).clamp(min=0) * neg  # row i: caption i against negative images j
    i2c = (margin + sim - pos[None, :]).clamp(min=0) * neg  # column j: image j against negative captions i
    return c2i.sum(dim=1).mean(), i2c.sum(dim=0).mean()


def _slots(out: dict) -> torch.Tensor | None:
    slots = out.get("slots")
    return None if slots is None else unit(slots)


# ---------------------------------------------------------------------------------------------- ranking losses

# Which hinge directions the triplet keeps, by cfg.loss.triplet.direction.
TRIPLET_DIRECTIONS = {"both": ("triplet_c2i", "triplet_i2c"), "c2i": ("triplet_c2i",), "i2c": ("triplet_i2c",)}


@register_loss("triplet")
class Triplet(Loss):
    """VSE++ (Faghri et al. 2018): hinge on unit(pred) . target (cosine for unit targets, |y| x cosine for raw ones,
    as the VSE++ + slots notebook) with in-batch negatives, in the directions named by
    `direction` (the VSE++ + slots seed uses caption->image only); hardest negative if max_violation else the sum
    over negatives; averaged (not summed) over the batch.

    From a random init the hardest-negative form can collapse every output onto one point (loss stuck at 2 x margin);
    VSE++ therefore warms up with the sum over negatives: hardest negatives start at epoch `warmup_epochs`."""

    def terms(self, out, batch, temperature):
        sim = unit(out["pred"]) @ self.target(batch).T  # [B, B]
        hardest = self.cfg.max_violation and self.epoch >= self.cfg.warmup_epochs
        c2i, i2c = _vse_hinge(sim, ~same_image(batch["img"]), self.cfg.margin, hardest)
        terms = {"triplet_c2i": c2i, "triplet_i2c": i2c}
        return {name: terms[name] for name in TRIPLET_DIRECTIONS[self.cfg.direction]}


@register_loss("slot_triplet")
class SlotTriplet(Loss):
    """Max-over-slots triplet: sim(caption i, image j) = max_k cos(slot_ik, y_j); VSE++ hardest-negative hinge."""

    min_slots = 1

    def terms(self, out, batch, temperature):
        slots = _slots(out)
        if slots is None:
            return {}
        sim = torch.einsum("bkd,nd->bkn", slots, self.target(batch)).max(dim=1).values  # [B, B]
        c2i, i2c = _vse_hinge(sim, ~same_image(batch["img"]), self.cfg.margin, hardest=True)
        return {"slot_triplet_c2i": c2i, "slot_triplet_i2c": i2c}


# ---------------------------------------------------------------------------------------------- slot regularisers

@register_loss("slot_infonce")
class SlotInfoNCE(Loss):
    """Per-slot InfoNCE (caption->image) at its own temperature `tau`, averaged over slots and captions."""

    min_slots = 1

    def terms(self, out, batch, temperature):
        slots = _slots(out)
        if slots is None:
            return {}
        b, k, _ = slots.shape
        logits = torch.einsum("bkd,nd->bkn", slots, self.target(batch)) / self.cfg.tau  # [B, K, B]
        keep = ~same_image(batch["img"]) | torch.eye(b, dtype=torch.bool, device=slots.device)
        target = torch.arange(b, device=slots.device).repeat_interleave(k)
        loss = masked_ce(logits.reshape(b * k, b), keep.repeat_interleave(k, dim=0), target)
        return {"slot_infonce": loss}


@register_loss("slot_diversity")
class SlotDiversity(Loss):
    """Intra-caption slot diversity: mean over slot pairs i < j of relu(cos(slot_i, slot_j) - delta)."""

    min_slots = 2

    def terms(self, out, batch, temperature):
        slots = _slots(out)
        if slots is None:
            return {}
        k = slots.shape[1]
        if k < 2:
            return {"slot_diversity": zero_like(slots)}
        gram = slots @ slots.transpose(1, 2)  # [B, K, K]
        # The pairs i < j by index, row-major as a triu mask would pick them: indexing by a bool mask waits for the
        # device to count its True entries, a host sync per step (issue 33).
        i, j = torch.triu_indices(k, k, offset=1, device=slots.device)
        return {"slot_diversity": (gram[:, i, j] - self.cfg.delta).clamp(min=0).mean()}


@register_loss("condensation")
class Condensation(Loss):
    """Condense the best slot into the prediction: mean over captions of 1 - cos(pred, s*), where
    s* = argmax_k cos(slot_k, y_n) is the caption's slot that best matches its own image (as the VSE++ + slots seed
    computes it). Nothing is detached, as in the seed: the gradient moves pred (the only vector used at inference)
    toward s* and s* toward pred; the other slots get none."""

    min_slots = 1

    def terms(self, out, batch, temperature):
        slots = _slots(out)
        if slots is None:
            return {}
        # argmax over k of slot_k . y is the same for y and any positive multiple: scale-free in the target
        best = torch.einsum("bkd,bd->bk", slots, unit(batch["y_n"])).argmax(dim=1)  # [B]
        s_star = slots[torch.arange(slots.shape[0], device=slots.device), best]  # [B, D]
        return {"condensation": (1.0 - (unit(out["pred"]) * s_star).sum(dim=-1)).mean()}


# ---------------------------------------------------------------------------------------------- InfoNCE family

@register_loss("infonce")
class InfoNCE(Loss):
    """CLIP InfoNCE on pred @ y_n.T / temperature(): same-image off-diagonal entries are masked out (removed from the
    softmax, no smoothing mass); symmetric = mean of caption->image and image->caption, else caption->image only."""

    def terms(self, out, batch, temperature):
        smoothing = self.cfg.label_smoothing
        logits = unit(out["pred"]) @ self.target(batch).T / temperature()  # [B, B]
        b = logits.shape[0]
        target = torch.arange(b, device=logits.device)
        keep = ~same_image(batch["img"]) | torch.eye(b, dtype=torch.bool, device=logits.device)
        loss = masked_ce(logits, keep, target, smoothing)
        if self.cfg.symmetric:
            loss = 0.5 * (loss + masked_ce(logits.T, keep.T, target, smoothing))
        return {"infonce": loss}


def unique_images(img: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(first [U]: index of one caption per distinct image, inverse [B]: each caption's position in 0..U-1)."""
    uniq, inverse = torch.unique(img, return_inverse=True)
    order = torch.arange(img.shape[0], device=img.device)
    first = torch.full((uniq.shape[0],), img.shape[0], dtype=torch.long, device=img.device)
    return first.scatter_reduce(0, inverse, order, reduce="amin"), inverse


@register_loss("multipos_infonce")
class MultiPosInfoNCE(Loss):
    """Multi-positive InfoNCE, mean of both directions, at temperature().

    caption->image: softmax over the U distinct images of the batch, target = the caption's image.
    image->caption (SupCon, Khosla et al. 2020): for each distinct image, the mean over ALL its captions of
    -log softmax over the B captions (positives stay in the denominator).
    label_smoothing eps (both directions, as torch's): the target puts eps uniformly over all columns (U images,
    resp. B captions) and 1 - eps on the positive(s); 0 = the unsmoothed loss.
    """

    def terms(self, out, batch, temperature):
        first, inverse = unique_images(batch["img"])
        p, y_u = unit(out["pred"]), self.target(batch)[first]  # [B, D], [U, D]
        logits = p @ y_u.T / temperature()  # [B, U]
        eps = self.cfg.label_smoothing
        c2i = F.cross_entropy(logits, inverse, label_smoothing=eps)
        return {"multipos_infonce": 0.5 * (c2i + multipos_i2c(logits, inverse, eps))}


# ---------------------------------------------------------------------------------------------- regression / alignment

@register_loss("cosine")
class Cosine(Loss):
    """Mean over captions of 1 - cos(pred, y_n) (cosine is scale-free, so pred and raw give the same value, and so
    do unit and raw targets: loss.targets does not change it)."""

    def terms(self, out, batch, temperature):
        return {"cosine": (1.0 - (unit(out["pred"]) * unit(batch["y_n"])).sum(dim=-1)).mean()}


@register_loss("moment")
class Moment(Loss):
    """Moment alignment of the prediction to the targets over the batch: squared L2 distance between the batch means
    and, if `std`, between the per-dimension (population) stds. Summed over dimensions (= D x MSE) so the term does
    not shrink as 1/D with the embedding width; the means alone are BigJump's ||mu_z - mu_y||^2. Unit targets: unit
    pred vs y_n; raw targets: the raw output vs raw y (`prediction`, `target`)."""

    def terms(self, out, batch, temperature):
        p, y = self.prediction(out), self.target(batch)  # [B, D] each
        terms = {"moment_mean": (p.mean(dim=0) - y.mean(dim=0)).pow(2).sum()}
        if self.cfg.std:
            terms["moment_std"] = (p.std(dim=0, correction=0) - y.std(dim=0, correction=0)).pow(2).sum()
        return terms


@register_loss("agreement")
class Agreement(Loss):
    """Caption agreement (BigJump): for each image with >= 2 captions in the batch, the per-dimension variance
    (unbiased, as torch.var) of its captions' normalised predictions, averaged over the D dimensions; then averaged
    over those images. 0 when no image has two captions in the batch."""

    def terms(self, out, batch, temperature):
        p = unit(out["pred"])
        first, inverse = unique_images(batch["img"])
        u = first.shape[0]
        counts = torch.bincount(inverse, minlength=u).float()  # [U]
        mean = torch.zeros(u, p.shape[1], device=p.device).index_add(0, inverse, p) / counts[:, None]  # [U, D]
        sq_dev = torch.zeros(u, device=p.device).index_add(0, inverse, (p - mean[inverse]).pow(2).mean(dim=1))  # [U]
        groups = counts >= 2  # [U]
        # The mean over the groups as a masked sum / count: selecting them (sq_dev[groups]) or testing groups.any()
        # on the host is a host sync per step (issue 33). No group: 0, still in p's graph. A single caption's
        # sq_dev is 0; the clamp only keeps its 0 / 0 out.
        per_image = sq_dev / (counts - 1.0).clamp(min=1.0)
        return {"agreement": (per_image * groups).sum() / groups.sum().clamp(min=1)}


@register_loss("mse")
class MSE(Loss):
    """MSE between the raw (unnormalised) output and the image target at the configured scale: the raw embedding
    (loss.targets = "raw") is the official baseline's loss (baseline_mse.toml sets it); the unit one regresses onto
    the direction only."""

    def terms(self, out, batch, temperature):
        return {"mse": F.mse_loss(out["raw"].float(), self.target(batch))}
