"""LossState: the losses' trainable and persistent state (temperature, FIFO image queue) plus loop-set fields.

Persistent (in `state_dict`): `logit_scale` (parameter), `queue` [Q, D], `queue_ptr` (long scalar, next write row),
`queue_count` (long scalar, valid rows, <= Q). Training checkpoints keep only `checkpoint_state()` (the logit scale).
Plain attributes set by the training loop (not saved): `epoch` (int, 0-based), `progress` (float in [0, 1] over the
whole run), `bank` [N, D] / `bank_labels` [N, L] (whole-training-set embeddings and labels for global hard negatives).

Queue layout invariant: while `queue_count < Q` the valid rows are 0..count-1 (oldest first) and `queue_ptr == count`;
once full, the oldest row sits at `queue_ptr`. Either way the newest n rows are (ptr - n .. ptr - 1) mod Q.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from trainers.config import Config


class LossState(nn.Module):
    """Temperature and queue state shared by the losses; built once per run as `LossState(cfg, dim_out)`."""

    def __init__(self, cfg: Config, dim_out: int):
        super().__init__()
        self.temperature = cfg.temperature
        self.queue_cfg = cfg.queue
        # CLIP init: logit_scale = log(1 / tau); only trained when temperature.mode == "learnable".
        self.logit_scale = nn.Parameter(
            torch.tensor(math.log(1.0 / cfg.temperature.tau), dtype=torch.float32),
            requires_grad=cfg.temperature.mode == "learnable",
        )
        # The queue is only allocated when queue_infonce is on: Q x D float32 is 16 MB at the defaults (4096 x 1024)
        # and would otherwise bloat every checkpoint of a sweep for nothing.
        rows = cfg.queue.size if cfg.loss.queue_infonce.weight > 0 else 0
        self.register_buffer("queue", torch.zeros(rows, dim_out, dtype=torch.float32))
        self.register_buffer("queue_ptr", torch.zeros((), dtype=torch.long))
        self.register_buffer("queue_count", torch.zeros((), dtype=torch.long))
        self.epoch: int = 0
        self.progress: float = 0.0
        self.bank: torch.Tensor | None = None
        self.bank_labels: torch.Tensor | None = None

    # ------------------------------------------------------------------------------------------ temperature

    def tau(self) -> torch.Tensor:
        """The InfoNCE temperature as a float32 scalar tensor on this module's device.

        fixed: temperature.tau. learnable: 1 / exp(logit_scale), the scale clamped at max_logit_scale (as CLIP does,
        so tau >= 1 / max_logit_scale). curriculum: cosine interpolation from tau_start (progress 0) to tau_end
        (progress 1): tau = tau_end + (tau_start - tau_end) * (1 + cos(pi * progress)) / 2.
        """
        t = self.temperature
        device = self.logit_scale.device
        if t.mode == "learnable":
            scale = self.logit_scale.float().clamp(max=math.log(t.max_logit_scale)).exp()
            return 1.0 / scale
        if t.mode == "curriculum":
            p = min(max(float(self.progress), 0.0), 1.0)
            value = t.tau_end + (t.tau_start - t.tau_end) * 0.5 * (1.0 + math.cos(math.pi * p))
            return torch.tensor(value, dtype=torch.float32, device=device)
        return torch.tensor(t.tau, dtype=torch.float32, device=device)

    def log_values(self) -> dict[str, float]:
        """Per-epoch metrics: the temperature now (train/tau) when it moves (learnable or curriculum)."""
        if self.temperature.mode == "fixed":
            return {}
        return {"train/tau": float(self.tau().detach())}

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps of this state: the (learned) logit scale. The queue is left out: a 65,536-row
        queue is 400 MB of image embeddings, rebuilt in the first epoch anyway."""
        return {"logit_scale": self.logit_scale.detach().cpu().clone()}

    def load_checkpoint_state(self, saved: dict[str, torch.Tensor]) -> None:
        """Restore what `checkpoint_state` saved (the queue keeps its current contents)."""
        with torch.no_grad():
            self.logit_scale.copy_(saved["logit_scale"])

    # ------------------------------------------------------------------------------------------ queue

    @torch.no_grad()
    def enqueue(self, y_n: torch.Tensor) -> None:
        """Append a batch of normalised image embeddings [B, D] (FIFO, wrap-around; a batch > Q keeps its newest Q)."""
        size = self.queue.shape[0]
        if size == 0 or y_n.shape[0] == 0:
            return
        y = y_n.detach().to(device=self.queue.device, dtype=self.queue.dtype)
        if y.shape[0] >= size:
            # Only the newest Q rows survive; write them oldest-first from row 0 so the layout invariant holds.
            self.queue.copy_(y[-size:])
            self.queue_ptr.zero_()
            self.queue_count.fill_(size)
            return
        rows = (self.queue_ptr + torch.arange(y.shape[0], device=self.queue.device)) % size
        self.queue[rows] = y
        self.queue_ptr.copy_((self.queue_ptr + y.shape[0]) % size)
        self.queue_count.copy_(torch.clamp(self.queue_count + y.shape[0], max=size))

    def slice_fraction(self) -> float:
        """Fraction of the valid queue used now, by queue.slice_mode (SLICE_SHAPES); slice_epochs == 0: the whole
        queue at once."""
        q = self.queue_cfg
        if q.slice_epochs == 0:
            return 1.0
        return min(1.0, SLICE_SHAPES[q.slice_mode](q, max(self.epoch - q.warmup_epochs, 0)))

    def queue_negatives(self) -> torch.Tensor:
        """[M, D] queue rows to use as extra negatives, oldest first: empty during warmup epochs, else the newest
        round(fraction * count) valid rows (at least one)."""
        empty = self.queue.new_zeros((0, self.queue.shape[1]))
        if self.epoch < self.queue_cfg.warmup_epochs:
            return empty
        count = int(self.queue_count)
        if count == 0:
            return empty
        n = min(count, max(1, round(self.slice_fraction() * count)))
        rows = (self.queue_ptr - n + torch.arange(n, device=self.queue.device)) % self.queue.shape[0]
        return self.queue[rows]


# Used queue fraction after `after` (>= 0) post-warmup epochs, by queue.slice_mode.
SLICE_SHAPES = {
    # slice_start right after warmup, growing linearly to 1 over slice_epochs epochs
    "linear": lambda q, after: q.slice_start + (1.0 - q.slice_start) * after / q.slice_epochs,
    # slice_start, doubled every slice_epochs epochs: BigJump's recent slices 16k -> 32k -> 65k of a 65,536 queue are
    # slice_start = 0.25 with slice_epochs = 1
    "stepwise": lambda q, after: q.slice_start * 2.0 ** (after // q.slice_epochs),
}
