"""The losses registry (translation losses here), cross-knob loss validation and `compute_losses` for the loop.

Every entry is `fn(out, batch, cfg_term, state) -> dict[str, Tensor]`: named UNWEIGHTED scalar terms whose sum is the
loss; the loop weights the sum by `cfg.loss.<name>.weight`. Registry names equal the `LossCfg` field names.
Conventions shared by all losses:
  * Everything is computed in float32 with autocast disabled (inputs cast with .float()), so logits divided by a
    small temperature cannot overflow half precision.
  * Cosine similarities: `pred`, `slots` and `y_n` are (re-)normalised here, so `model.out_norm = false` is fine;
    `compute_losses` tells `unit` which float32 tensors are unit already (y_n; pred when model.out_norm), so the
    hot path does not normalise them twice.
  * False negatives: captions of the same image (equal batch["img"]) are never negatives of each other; contrastive
    losses mask them out (multipos_infonce instead counts them as positives).
`LossState` lives in trainers/loss_state.py and the multi-label triplet in trainers/losses_multilabel.py; both are
importable from here (importing this module registers every loss).
"""
from __future__ import annotations

import contextvars
import functools

import torch
import torch.nn.functional as F

from trainers.config import Config
from trainers.errors import ConfigError
from trainers.loss_state import LossState
from trainers.registry import Registry

LOSSES = Registry("loss")

# Fill value for masked logits: finite (not -inf) so that 0 * log_softmax stays 0 in the label-smoothing sum, and far
# below any real logit (|cos| / tau <= 1e4 for the smallest allowed tau, 1e-4).
_MASKED = -1e9
# The float32 tensors of the current `compute_losses` call that are L2-normalised already (`unit` returns them as is).
_KNOWN_UNIT: contextvars.ContextVar[tuple[torch.Tensor, ...]] = contextvars.ContextVar("known_unit", default=())
# Losses that read out["slots"] and therefore need the slot head (cfg.slots.k > 0).
SLOT_LOSSES = ("slot_triplet", "slot_infonce", "slot_diversity", "condensation")

__all__ = ["LOSSES", "LossState", "SLOT_LOSSES", "compute_losses", "validate", "register_loss"]


def register_loss(name: str):
    """Register `fn` under `name`, wrapped so that it always runs with autocast disabled (float32 logits)."""

    def deco(fn):
        @functools.wraps(fn)
        def wrapped(out, batch, cfg_term, state):
            with torch.autocast(device_type=out["pred"].device.type, enabled=False):
                return fn(out, batch, cfg_term, state)

        LOSSES.register(name)(wrapped)
        return fn

    return deco


# ---------------------------------------------------------------------------------------------- helpers

def unit(x: torch.Tensor) -> torch.Tensor:
    """float32 rows L2-normalised along the last dim (eps guards zero vectors); a known-unit tensor as is."""
    if any(x is known for known in _KNOWN_UNIT.get()):
        return x
    x = x.float()
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-8)  # = F.normalize(x, dim=-1, eps=1e-8), see l2_normalize


def same_image(img: torch.Tensor) -> torch.Tensor:
    """[B, B] bool: captions i and j describe the same image (diagonal included)."""
    return img[:, None] == img[None, :]


def zero_like(t: torch.Tensor) -> torch.Tensor:
    """A 0 that stays in the autograd graph of `t` (so backward works even if it is the only term)."""
    return t.float().sum() * 0.0


def masked_ce(logits: torch.Tensor, keep: torch.Tensor, target: torch.Tensor, smoothing: float = 0.0) -> torch.Tensor:
    """Mean cross-entropy over rows of logits [N, C] with columns where keep [N, C] is False removed.

    Label smoothing (as in torch: eps spread uniformly, target gets 1 - eps + eps / C) is spread only over the kept
    columns, so masked false negatives receive no probability mass. The target column must be kept.
    """
    logp = logits.masked_fill(~keep, _MASKED).log_softmax(dim=-1)
    nll = -logp.gather(1, target[:, None]).squeeze(1)
    if smoothing == 0.0:
        return nll.mean()
    uniform = -(logp * keep).sum(dim=-1) / keep.sum(dim=-1)
    return ((1.0 - smoothing) * nll + smoothing * uniform).mean()


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
def triplet(out, batch, cfg_term, state):
    """VSE++ (Faghri et al. 2018): hinge on cosine with in-batch negatives, in the directions named by
    `direction` (the VSE++ + slots seed uses caption->image only); hardest negative if max_violation else the sum
    over negatives; averaged (not summed) over the batch.

    From a random init the hardest-negative form can collapse every output onto one point (loss stuck at 2 x margin);
    VSE++ therefore warms up with the sum over negatives: hardest negatives start at epoch `warmup_epochs`."""
    sim = unit(out["pred"]) @ unit(batch["y_n"]).T
    hardest = cfg_term.max_violation and (state is None or state.epoch >= cfg_term.warmup_epochs)
    c2i, i2c = _vse_hinge(sim, ~same_image(batch["img"]), cfg_term.margin, hardest)
    terms = {"triplet_c2i": c2i, "triplet_i2c": i2c}
    return {name: terms[name] for name in TRIPLET_DIRECTIONS[cfg_term.direction]}


@register_loss("slot_triplet")
def slot_triplet(out, batch, cfg_term, state):
    """Max-over-slots triplet: sim(caption i, image j) = max_k cos(slot_ik, y_j); VSE++ hardest-negative hinge."""
    slots = _slots(out)
    if slots is None:
        return {}
    sim = torch.einsum("bkd,nd->bkn", slots, unit(batch["y_n"])).max(dim=1).values  # [B, B]
    c2i, i2c = _vse_hinge(sim, ~same_image(batch["img"]), cfg_term.margin, hardest=True)
    return {"slot_triplet_c2i": c2i, "slot_triplet_i2c": i2c}


# ---------------------------------------------------------------------------------------------- slot regularisers

@register_loss("slot_infonce")
def slot_infonce(out, batch, cfg_term, state):
    """Per-slot InfoNCE (caption->image) at temperature cfg_term.tau, averaged over slots and captions."""
    slots = _slots(out)
    if slots is None:
        return {}
    b, k, _ = slots.shape
    logits = torch.einsum("bkd,nd->bkn", slots, unit(batch["y_n"])) / cfg_term.tau  # [B, K, B]
    keep = ~same_image(batch["img"]) | torch.eye(b, dtype=torch.bool, device=slots.device)
    target = torch.arange(b, device=slots.device).repeat_interleave(k)
    loss = masked_ce(logits.reshape(b * k, b), keep.repeat_interleave(k, dim=0), target)
    return {"slot_infonce": loss}


@register_loss("slot_diversity")
def slot_diversity(out, batch, cfg_term, state):
    """Intra-caption slot diversity: mean over slot pairs i < j of relu(cos(slot_i, slot_j) - delta)."""
    slots = _slots(out)
    if slots is None:
        return {}
    k = slots.shape[1]
    if k < 2:
        return {"slot_diversity": zero_like(slots)}
    gram = slots @ slots.transpose(1, 2)  # [B, K, K]
    upper = torch.triu(torch.ones(k, k, dtype=torch.bool, device=slots.device), diagonal=1)
    return {"slot_diversity": (gram[:, upper] - cfg_term.delta).clamp(min=0).mean()}


@register_loss("condensation")
def condensation(out, batch, cfg_term, state):
    """Condense the best slot into the prediction: mean over captions of 1 - cos(pred, s*), where
    s* = argmax_k cos(slot_k, y_n) is the caption's slot that best matches its own image (as the VSE++ + slots seed
    computes it). Nothing is detached, as in the seed: the gradient moves pred (the only vector used at inference)
    toward s* and s* toward pred; the other slots get none."""
    slots = _slots(out)
    if slots is None:
        return {}
    best = torch.einsum("bkd,bd->bk", slots, unit(batch["y_n"])).argmax(dim=1)  # [B]
    s_star = slots[torch.arange(slots.shape[0], device=slots.device), best]  # [B, D]
    return {"condensation": (1.0 - (unit(out["pred"]) * s_star).sum(dim=-1)).mean()}


# ---------------------------------------------------------------------------------------------- InfoNCE family

@register_loss("infonce")
def infonce(out, batch, cfg_term, state):
    """CLIP InfoNCE on pred @ y_n.T / state.tau(): same-image off-diagonal entries are masked out (removed from the
    softmax, no smoothing mass); symmetric = mean of caption->image and image->caption, else caption->image only."""
    logits = unit(out["pred"]) @ unit(batch["y_n"]).T / state.tau()
    b = logits.shape[0]
    target = torch.arange(b, device=logits.device)
    keep = ~same_image(batch["img"]) | torch.eye(b, dtype=torch.bool, device=logits.device)
    loss = masked_ce(logits, keep, target, cfg_term.label_smoothing)
    if cfg_term.symmetric:
        loss = 0.5 * (loss + masked_ce(logits.T, keep.T, target, cfg_term.label_smoothing))
    return {"infonce": loss}


def _unique_images(img: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(first [U]: index of one caption per distinct image, inverse [B]: each caption's position in 0..U-1)."""
    uniq, inverse = torch.unique(img, return_inverse=True)
    order = torch.arange(img.shape[0], device=img.device)
    first = torch.full((uniq.shape[0],), img.shape[0], dtype=torch.long, device=img.device)
    return first.scatter_reduce(0, inverse, order, reduce="amin"), inverse


@register_loss("multipos_infonce")
def multipos_infonce(out, batch, cfg_term, state):
    """Multi-positive InfoNCE, mean of both directions, at state.tau().

    caption->image: softmax over the U distinct images of the batch, target = the caption's image.
    image->caption (SupCon, Khosla et al. 2020): for each distinct image, the mean over ALL its captions of
    -log softmax over the B captions (positives stay in the denominator).
    label_smoothing eps (both directions, as torch's): the target puts eps uniformly over all columns (U images,
    resp. B captions) and 1 - eps on the positive(s); 0 = the unsmoothed loss.
    """
    first, inverse = _unique_images(batch["img"])
    p, y_u = unit(out["pred"]), unit(batch["y_n"])[first]  # [B, D], [U, D]
    logits = p @ y_u.T / state.tau()  # [B, U]
    eps = cfg_term.label_smoothing
    c2i = F.cross_entropy(logits, inverse, label_smoothing=eps)
    positives = (inverse[None, :] == torch.arange(first.shape[0], device=p.device)[:, None]).float()  # [U, B]
    logp = logits.T.log_softmax(dim=-1)
    i2c = (-(logp * positives).sum(dim=-1) / positives.sum(dim=-1)).mean()
    i2c = (1.0 - eps) * i2c - eps * logp.mean(dim=-1).mean()  # eps uniform over the B captions
    return {"multipos_infonce": 0.5 * (c2i + i2c)}


# Queue rows at least this cosine-similar to a caption's own image are treated as that image (a copy enqueued in an
# earlier step) and masked as false negatives; distinct real images are far below (float32 rounding is ~1e-7).
_SAME_IMAGE_COS = 1.0 - 1e-5


@register_loss("queue_infonce")
def queue_infonce(out, batch, cfg_term, state):
    """caption->image InfoNCE over in-batch images plus the queue negatives (state.queue_negatives(), detached)
    at state.tau(); in-batch same-image columns and queue copies of the caption's own image are masked; with an
    empty queue (warmup) this is plain in-batch InfoNCE. label_smoothing is spread over the kept columns (masked_ce).

    With queue.in_batch = false (MoCo: logits = [l_pos, l_neg over the queue]) the only in-batch column is the
    caption's own image; the loss is then 0 while the queue is still empty."""
    p, y = unit(out["pred"]), unit(batch["y_n"])
    queue = state.queue_negatives().to(device=p.device, dtype=torch.float32).detach()
    b = p.shape[0]
    keep_batch = ~same_image(batch["img"]) | torch.eye(b, dtype=torch.bool, device=p.device)
    if not state.queue_cfg.in_batch:
        keep_batch = torch.eye(b, dtype=torch.bool, device=p.device)
    keep_queue = (y @ queue.T) < _SAME_IMAGE_COS  # [B, M]
    logits = p @ torch.cat([y, queue]).T / state.tau()  # [B, B + M]
    keep = torch.cat([keep_batch, keep_queue], dim=1)
    return {"queue_infonce": masked_ce(logits, keep, torch.arange(b, device=p.device), cfg_term.label_smoothing)}


# ---------------------------------------------------------------------------------------------- regression / alignment

@register_loss("cosine")
def cosine(out, batch, cfg_term, state):
    """Mean over captions of 1 - cos(pred, y_n) (cosine is scale-free, so pred and raw give the same value)."""
    return {"cosine": (1.0 - (unit(out["pred"]) * unit(batch["y_n"])).sum(dim=-1)).mean()}


@register_loss("moment")
def moment(out, batch, cfg_term, state):
    """Moment alignment of normalised pred to y_n over the batch: squared L2 distance between the batch means and,
    if cfg_term.std, between the per-dimension (population) stds. Summed over dimensions (= D x MSE) so the term
    does not shrink as 1/D with the embedding width; the means alone are BigJump's ||mu_z - mu_y||^2."""
    p, y = unit(out["pred"]), unit(batch["y_n"])
    terms = {"moment_mean": (p.mean(dim=0) - y.mean(dim=0)).pow(2).sum()}
    if cfg_term.std:
        terms["moment_std"] = (p.std(dim=0, correction=0) - y.std(dim=0, correction=0)).pow(2).sum()
    return terms


@register_loss("agreement")
def agreement(out, batch, cfg_term, state):
    """Caption agreement (BigJump): for each image with >= 2 captions in the batch, the per-dimension variance
    (unbiased, as torch.var) of its captions' normalised predictions, averaged over the D dimensions; then averaged
    over those images. 0 when no image has two captions in the batch."""
    p = unit(out["pred"])
    first, inverse = _unique_images(batch["img"])
    u = first.shape[0]
    counts = torch.bincount(inverse, minlength=u).float()  # [U]
    mean = torch.zeros(u, p.shape[1], device=p.device).index_add(0, inverse, p) / counts[:, None]  # [U, D]
    sq_dev = torch.zeros(u, device=p.device).index_add(0, inverse, (p - mean[inverse]).pow(2).mean(dim=1))  # [U]
    groups = counts >= 2
    if not bool(groups.any()):
        return {"agreement": zero_like(p)}
    return {"agreement": (sq_dev[groups] / (counts[groups] - 1.0)).mean()}


@register_loss("mse")
def mse(out, batch, cfg_term, state):
    """MSE between the raw (unnormalised) output and the raw image embedding: the official baseline's loss."""
    return {"mse": F.mse_loss(out["raw"].float(), batch["y"].float())}


# ---------------------------------------------------------------------------------------------- loop entry points

def _weight(cfg: Config, name: str) -> float:
    return float(getattr(cfg.loss, name).weight)


def validate(cfg: Config) -> None:
    """Cross-knob checks of the loss config; raises ConfigError with one line naming the keys."""
    active = [name for name in LOSSES.names() if _weight(cfg, name) > 0]
    if not active:
        raise ConfigError(f"loss: no loss has a positive weight (set one of loss.<name>.weight > 0; "
                          f"names: {', '.join(LOSSES.names())})")
    for name in active:
        if name in SLOT_LOSSES and cfg.slots.k == 0:
            raise ConfigError(f"loss.{name}.weight > 0 needs the slot head: set slots.k > 0")
    if "slot_diversity" in active and cfg.slots.k < 2:
        raise ConfigError(f"loss.slot_diversity.weight > 0 needs slots.k >= 2 (got {cfg.slots.k})")
    if cfg.queue.slice_mode == "stepwise" and cfg.queue.slice_start == 0 and cfg.queue.slice_epochs > 0:
        raise ConfigError("queue.slice_mode = 'stepwise' doubles queue.slice_start, which must then be > 0")
    if "multilabel_triplet" in active and cfg.data.task != "multilabel":
        raise ConfigError(f"loss.multilabel_triplet.weight > 0 needs data.task = 'multilabel' (got '{cfg.data.task}')")


def compute_losses(cfg: Config, out: dict, batch: dict,
                   state: LossState) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(total = sum over losses with weight > 0 of weight * sum(terms), {term name: detached value})."""
    total: torch.Tensor | None = None
    logged: dict[str, torch.Tensor] = {}
    token = _KNOWN_UNIT.set(_known_unit(cfg, out, batch))
    try:
        for name in LOSSES.names():
            weight = _weight(cfg, name)
            if weight <= 0:
                continue
            terms = LOSSES.get(name)(out, batch, getattr(cfg.loss, name), state)
            for key, value in terms.items():
                total = weight * value if total is None else total + weight * value
                logged[key] = value.detach()
    finally:
        _KNOWN_UNIT.reset(token)
    return (zero_like(out["pred"]) if total is None else total), logged


def _known_unit(cfg: Config, out: dict, batch: dict) -> tuple[torch.Tensor, ...]:
    """y_n is unit by the batch contract, pred by the model contract when model.out_norm; float32 only (a half
    precision pred re-normalised in float32 differs)."""
    known = [batch.get("y_n"), out["pred"] if cfg.model.out_norm else None]
    return tuple(t for t in known if t is not None and t.dtype == torch.float32)


from trainers import losses_multilabel  # noqa: E402,F401  (registers multilabel_triplet into LOSSES)
