"""The queue InfoNCE loss ("queue_infonce") and its FIFO queue of earlier batches' image embeddings (MoCo style).

The loss owns its queue: buffers `queue` [Q, D] float32 (image targets at the loss.targets scale), `queue_img` [Q]
long (each row's training image, -1 when unknown), `queue_ptr` (long scalar, next write row) and `queue_count` (long
scalar, valid rows, <= Q), filled by its own `after_step` and moved by `.to(device)` with the criterion. They
are NON-persistent buffers, so neither `state_dict()` nor a checkpoint holds them: a 65,536 x 1536 queue is 400 MB
per trial checkpoint, and the queue is rebuilt in the first epoch (the warm-up epochs are enqueue-only anyway).
The queue only exists while the loss is on (the criterion builds active losses only). Before the first epoch a
queue larger than the training images is capped at their number: the targets are fixed embeddings, so more rows only
repeat images (loss.all_images_infonce is the exact limit: every image once).

Queue layout invariant: while `queue_count < Q` the valid rows are 0..count-1 (oldest first) and `queue_ptr == count`;
once full, the oldest row sits at `queue_ptr`. Either way the newest n rows are (ptr - n .. ptr - 1) mod Q.
"""
from __future__ import annotations

import torch

from latentsweep.trainers.config.tree import QueueInfoNCECfg
from latentsweep.trainers.core.errors import ConfigError
from latentsweep.trainers.losses.base import EpochContext, Loss, masked_ce, register_loss, same_image, unit
from latentsweep.trainers.core.progress import say

# Queue rows at least this cosine-similar to a caption's own image are treated as that image (a copy enqueued in an
# earlier step) and masked as false negatives; distinct real images are far below (float32 rounding is ~1e-7).
_SAME_IMAGE_COS = 1.0 - 1e-5


# Used queue fraction after `after` (>= 0) post-warmup epochs, by loss.queue_infonce.slice_mode.
SLICE_SHAPES = {
    # slice_start right after warmup, growing linearly to 1 over slice_epochs epochs
    "linear": lambda q, after: q.slice_start + (1.0 - q.slice_start) * after / q.slice_epochs,
    # slice_start, doubled every slice_epochs epochs: BigJump's recent slices 16k -> 32k -> 65k of a 65,536 queue are
    # slice_start = 0.25 with slice_epochs = 1
    "stepwise": lambda q, after: q.slice_start * 2.0 ** (after // q.slice_epochs),
}


@register_loss("queue_infonce")
class QueueInfoNCE(Loss):
    """caption->image InfoNCE over in-batch images plus the queue negatives (`queue_negatives()`, detached) at
    temperature(); in-batch same-image columns and queue copies of the caption's own image are masked; with an
    empty queue (warmup) this is plain in-batch InfoNCE. label_smoothing is spread over the kept columns (masked_ce).

    With in_batch = false (MoCo: logits = [l_pos, l_neg over the queue]) the only in-batch column is the caption's
    own image; the loss is then 0 while the queue is still empty."""

    cfg: QueueInfoNCECfg

    @classmethod
    def check(cls, cfg: QueueInfoNCECfg) -> None:
        if cfg.slice_mode == "stepwise" and cfg.slice_start == 0 and cfg.slice_epochs > 0:
            raise ConfigError("loss.queue_infonce.slice_mode = 'stepwise' doubles loss.queue_infonce.slice_start, "
                              "which must then be > 0")

    @classmethod
    def capture_refusal(cls, cfg: QueueInfoNCECfg) -> str | None:
        return "loss.queue_infonce: its queue grows on the host every step (a recompile per step)"

    def __init__(self, cfg: QueueInfoNCECfg, dim_out: int, targets: str = "unit"):
        super().__init__(cfg, dim_out, targets)
        self.register_buffer("queue", torch.zeros(cfg.size, dim_out, dtype=torch.float32), persistent=False)
        self.register_buffer("queue_ptr", torch.zeros((), dtype=torch.long), persistent=False)
        self.register_buffer("queue_count", torch.zeros((), dtype=torch.long), persistent=False)
        # [Q] long: the training image of each queued row (-1: unknown), so that copies of a caption's own image are
        # masked by index instead of by a second [B, Q] similarity product
        self.register_buffer("queue_img", torch.full((cfg.size,), -1, dtype=torch.long), persistent=False)
        # The host's copy of queue_count: every step slices the queue by it, and reading the device scalar instead
        # (int(queue_count)) was a host sync per step (issue 33). enqueue keeps the two equal.
        self.filled = 0

    def terms(self, out, batch, temperature):
        p, y = unit(out["pred"]), self.target(batch)  # [B, D]; the queue holds targets at the same scale
        queue = self.queue_negatives().to(device=p.device, dtype=torch.float32).detach()
        b = p.shape[0]
        keep_batch = ~same_image(batch["img"]) | torch.eye(b, dtype=torch.bool, device=p.device)
        if not self.cfg.in_batch:
            keep_batch = torch.eye(b, dtype=torch.bool, device=p.device)
        keep_queue = self._not_own_image(batch, y, queue)  # [B, M]
        logits = p @ torch.cat([y, queue]).T / temperature()  # [B, B + M]
        keep = torch.cat([keep_batch, keep_queue], dim=1)
        return {"queue_infonce": masked_ce(logits, keep, torch.arange(b, device=p.device), self.cfg.label_smoothing)}

    def on_epoch_start(self, epoch: int, ctx: EpochContext | None) -> None:
        """Before the first epoch, cap the queue at the number of distinct training images (said once per size)."""
        super().on_epoch_start(epoch, ctx)
        n = None if ctx is None else ctx.n_targets
        if n is not None and 0 < n < self.queue.shape[0] and self.filled == 0:
            say(f"latentsweep: loss.queue_infonce.size {self.queue.shape[0]} is more than the {n} distinct "
                f"training images; the queue is capped at {n} (a larger one only repeats images; "
                "loss.all_images_infonce uses each image once, exactly)", once=("queue cap", self.queue.shape[0], n))
            self.queue = self.queue.new_zeros((n, self.queue.shape[1]))
            self.queue_img = self.queue_img.new_full((n,), -1)

    def _not_own_image(self, batch: dict, y: torch.Tensor, queue: torch.Tensor) -> torch.Tensor:
        """[B, M] bool: queue row m is not a copy of caption b's own image. Training batches carry each caption's
        training image (`image_idx`, untouched by augmentation): compared with the queued rows' images, at no
        matmul cost. Otherwise (the val loss, whose images are not the queue's) by cosine >= _SAME_IMAGE_COS."""
        if "image_idx" in batch and queue.shape[0]:
            return self.queue_img[self._recent_rows(queue.shape[0])][None, :] != batch["image_idx"][:, None]
        if self.raw_targets:  # the threshold is a cosine
            y, queue = unit(y), unit(queue)
        return (y @ queue.T) < _SAME_IMAGE_COS

    def after_step(self, out: dict, batch: dict) -> None:
        """Enqueue the step's real (un-augmented) images, at the target scale (loss.targets)."""
        self.enqueue(batch["y"] if self.raw_targets else batch["y_n"], batch.get("image_idx"))

    @torch.no_grad()
    def enqueue(self, y_n: torch.Tensor, image_idx: torch.Tensor | None = None) -> None:
        """Append a batch of image embeddings [B, D] (unit, or raw for raw targets) and their training images [B]
        (None: unknown, -1) (FIFO, wrap-around; a batch > Q keeps its newest Q)."""
        size = self.queue.shape[0]
        if size == 0 or y_n.shape[0] == 0:
            return
        y = y_n.detach().to(device=self.queue.device, dtype=self.queue.dtype)
        # Unknown ids are filled on the device (a host tensor copied over would be a copy per step).
        ids = (torch.full((y.shape[0],), -1, dtype=torch.long, device=self.queue_img.device) if image_idx is None
               else image_idx.detach().to(self.queue_img.device))
        if y.shape[0] >= size:
            # Only the newest Q rows survive; write them oldest-first from row 0 so the layout invariant holds.
            self.queue.copy_(y[-size:])
            self.queue_img.copy_(ids[-size:])
            self.queue_ptr.zero_()
            self.queue_count.fill_(size)
            self.filled = size
            return
        rows = (self.queue_ptr + torch.arange(y.shape[0], device=self.queue.device)) % size
        self.queue[rows] = y
        self.queue_img[rows] = ids
        self.queue_ptr.copy_((self.queue_ptr + y.shape[0]) % size)
        self.queue_count.copy_(torch.clamp(self.queue_count + y.shape[0], max=size))
        self.filled = min(self.filled + y.shape[0], size)

    def slice_fraction(self) -> float:
        """Fraction of the valid queue used now, by slice_mode (SLICE_SHAPES); slice_epochs == 0: the whole queue."""
        q = self.cfg
        if q.slice_epochs == 0:
            return 1.0
        return min(1.0, SLICE_SHAPES[q.slice_mode](q, max(self.epoch - q.warmup_epochs, 0)))

    def queue_negatives(self) -> torch.Tensor:
        """[M, D] queue rows to use as extra negatives, oldest first: empty during warmup epochs, else the newest
        round(fraction * count) valid rows (at least one)."""
        empty = self.queue.new_zeros((0, self.queue.shape[1]))
        if self.epoch < self.cfg.warmup_epochs:
            return empty
        count = self.filled  # = queue_count, read without a device sync
        if count == 0:
            return empty
        return self.queue[self._recent_rows(min(count, max(1, round(self.slice_fraction() * count))))]

    def _recent_rows(self, n: int) -> torch.Tensor:
        """[n] long: the queue rows of the newest n entries, oldest first."""
        return (self.queue_ptr - n + torch.arange(n, device=self.queue.device)) % self.queue.shape[0]
