"""The multi-label retrieval triplet loss ("multilabel_triplet") and its global hard-negative bank.

Batch: "labels" [B, L] bool; out["pred"] [B, D] item embeddings; for negatives = "random" or "step_hard" also
out["neg_pred"] [B, D] (the model's output for batch["neg_x"]: one item per anchor sharing no label with it, drawn
at random or, for step_hard, the one the live model ranks closest among all training items, chosen by the task).
Label rules (for anchor a and candidate c):
  positive, positives = "all": identical non-empty label sets. If the anchor has no such partner in the batch it falls
      back to the "any" rule for that anchor.
  positive, positives = "any": at least one shared label.
  positive, positives = "fixed": one item per anchor drawn once before training by `draw_fixed_positives` (the
      multi-label seed's pairs); its embedding is out["pos_pred"] [B, D] (the model's output for batch["pos_x"]),
      batch["has_pos"] [B] bool marks anchors that have one.
  negative: no shared label (the anchor itself is never its own positive or negative).
Distance d = 1 - cos. Per anchor: hinge relu(margin + d(a, hardest positive) - d(a, negative)) where the negative is
  batch_hard: the closest in-batch negative; global_hard: the closest negative in the loss's own `bank` [N, D]
  (labels `bank_labels` [N, L]; every training item embedded by the model, refreshed in `on_epoch_start`; before the
  first refresh, bank is None and the in-batch hardest negative is used); random and step_hard: out["neg_pred"] of
  the same row (step_hard is the seed's: mined over the whole training set every step, with gradient through the
  negative's embedding).
Anchors without a positive or a negative are skipped; the loss is the mean over the remaining anchors (0 if none).
"""
from __future__ import annotations

import torch

from latentsweep.trainers.core.errors import ConfigError
from latentsweep.trainers.losses.base import EpochContext, Loss, register_loss, unit


# Negative modes whose negative the task supplies per anchor as batch["neg_x"] (the loss reads out["neg_pred"]).
TASK_NEGATIVES = ("random", "step_hard")


def label_relations(labels_a: torch.Tensor, labels_b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(same [A, C]: identical non-empty label sets, shares_any [A, C], shares_none [A, C]) for bool label rows."""
    a, b = labels_a.float(), labels_b.float()
    shared = a @ b.T  # [A, C] number of shared labels
    shares_any = shared > 0
    same = shares_any & (shared == a.sum(dim=1)[:, None]) & (shared == b.sum(dim=1)[None, :])
    return same, shares_any, ~shares_any


def positive_mask(labels: torch.Tensor, rule: str) -> torch.Tensor:
    """[B, B] bool in-batch positives of each anchor (self excluded) under rule "all" (with fallback) or "any"."""
    same, shares_any, _ = label_relations(labels, labels)
    not_self = ~torch.eye(labels.shape[0], dtype=torch.bool, device=labels.device)
    pos_any = shares_any & not_self
    if rule == "any":
        return pos_any
    pos_all = same & not_self
    return torch.where(pos_all.any(dim=1, keepdim=True), pos_all, pos_any)


def draw_fixed_positives(labels: torch.Tensor, generator: torch.Generator, chunk: int = 4096) -> torch.Tensor:
    """[N] long: for each item, one random other item sharing a label with it, or -1 if none; drawn once.

    As the seed's code draws them: a random one of the anchor's labels, then a random other item carrying that label
    (its intended "share all labels first" rule intersects with an empty set and never fires).
    """
    labels = labels.bool().cpu()
    n = labels.shape[0]
    out = torch.full((n,), -1, dtype=torch.long)
    has_label = labels.any(dim=1)
    label = torch.zeros(n, dtype=torch.long)
    label[has_label] = torch.multinomial(labels[has_label].float(), 1, generator=generator).squeeze(1)
    for start in range(0, n, chunk):
        rows = torch.arange(start, min(start + chunk, n))
        cand = labels[:, label[rows]].T & has_label[rows, None]  # [c, N] items carrying the drawn label
        cand[torch.arange(len(rows)), rows] = False
        ok = cand.any(dim=1)
        if bool(ok.any()):
            out[rows[ok]] = torch.multinomial(cand[ok].float(), 1, generator=generator).squeeze(1)
    return out


def negative_mask(labels_a: torch.Tensor, labels_c: torch.Tensor) -> torch.Tensor:
    """[A, C] bool: candidate c shares no label with anchor a."""
    return label_relations(labels_a, labels_c)[2]


def _hardest_negative_distance(p, labels, cfg_term, bank, bank_labels, out) -> tuple[torch.Tensor, torch.Tensor]:
    """(d(a, negative) [B], has_negative [B] bool) for the configured mining mode."""
    b = p.shape[0]
    if cfg_term.negatives in TASK_NEGATIVES:
        if out.get("neg_pred") is None:
            raise ConfigError(f"loss.multilabel_triplet.negatives = '{cfg_term.negatives}' needs out['neg_pred'] "
                              "(the task must supply batch['neg_x'])")
        dist = 1.0 - (p * unit(out["neg_pred"])).sum(dim=-1)
        return dist, torch.ones(b, dtype=torch.bool, device=p.device)
    if cfg_term.negatives == "global_hard" and bank is not None:
        neg = negative_mask(labels, bank_labels.to(p.device).bool())
        bank = unit(bank.detach().to(p.device))
        dist = 1.0 - p @ bank.T  # [B, N]
    else:
        neg = negative_mask(labels, labels) & ~torch.eye(b, dtype=torch.bool, device=p.device)
        dist = 1.0 - p @ p.T  # [B, B]
    # Cosine distance lies in [0, 2]; 3 marks "not a negative" so min() never picks it.
    return dist.masked_fill(~neg, 3.0).min(dim=1).values, neg.any(dim=1)


def _positive_distance(p, labels, cfg_term, out, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(d(a, positive) [B], has_positive [B] bool): the fixed positive, or the hardest in-batch one."""
    if cfg_term.positives == "fixed":
        if out.get("pos_pred") is None:
            raise ConfigError("loss.multilabel_triplet.positives = 'fixed' needs out['pos_pred'] "
                              "(the task must supply batch['pos_x'])")
        return 1.0 - (p * unit(out["pos_pred"])).sum(dim=-1), batch["has_pos"].to(p.device)
    pos = positive_mask(labels, cfg_term.positives)
    # Cosine distance lies in [0, 2]; -1 marks "not a positive" so max() never picks it.
    return (1.0 - p @ p.T).masked_fill(~pos, -1.0).max(dim=1).values, pos.any(dim=1)


@register_loss("multilabel_triplet")
class MultiLabelTriplet(Loss):
    """Hinge triplet on cosine distance with label-defined positives and mined negatives (see module docstring)."""

    task = "multilabel"

    def __init__(self, cfg, dim_out: int, targets: str = "unit"):
        super().__init__(cfg, dim_out, targets)  # no image targets: items vs items (validate refuses "raw")
        self.bank: torch.Tensor | None = None
        self.bank_labels: torch.Tensor | None = None

    @classmethod
    def batch_keys(cls, cfg) -> frozenset[str]:
        """neg_x: one non-sharing item per anchor (random or step_hard); pos_x / has_pos: the fixed positive drawn
        once."""
        keys = {"neg_x"} if cfg.negatives in TASK_NEGATIVES else set()
        return frozenset(keys | ({"pos_x", "has_pos"} if cfg.positives == "fixed" else set()))

    def on_epoch_start(self, epoch: int, ctx: EpochContext | None) -> None:
        """global_hard: embed every training item with the model as it starts this epoch (the negatives bank)."""
        super().on_epoch_start(epoch, ctx)
        if self.cfg.negatives == "global_hard" and ctx is not None:
            self.bank, self.bank_labels = ctx.embed_train(), ctx.train_labels

    def terms(self, out, batch, temperature):
        p = unit(out["pred"])
        labels = batch["labels"].to(p.device).bool()
        d_ap, has_pos = _positive_distance(p, labels, self.cfg, out, batch)
        d_an, has_neg = _hardest_negative_distance(p, labels, self.cfg, self.bank, self.bank_labels, out)
        valid = has_pos & has_neg  # [B]
        # The mean over valid anchors as a masked sum / count (0 with none, still in p's graph): selecting them
        # (d_ap[valid]) or testing valid.any() on the host is a host sync per step (issue 33). The distances of
        # invalid anchors are finite (the -1 / 3 fills), so the mask zeroes them.
        hinge = (self.cfg.margin + d_ap - d_an).clamp(min=0)  # [B]
        return {"multilabel_triplet": (hinge * valid).sum() / valid.sum().clamp(min=1)}
