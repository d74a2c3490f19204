"""The exact all-images InfoNCE ("all_images_infonce"): every distinct image of the split in the softmax.

The image targets are fixed, precomputed embeddings, so a MoCo-style queue of earlier batches' images is only a stale
sample of the training images with duplicates (a 65,536 queue over 2,804 images holds each image 6-23 times, and
every step also pays a [B, Q] product to mask those copies). Its limit is a softmax over the bank of all distinct
images of the split, each once, which costs one [B, Ni] product. The task supplies the bank per batch (declared in
`batch_keys`): `bank` [Ni, D] unit image embeddings (the training images, or the val images for the val loss) and
`bank_idx` [B] each caption's row in it, which augmentation leaves alone. The bank is at the loss.targets scale
(unit, or raw for raw targets: the task supplies it so).

Logits are `pred @ [y_n; bank].T / tau` [B, B + Ni] with only caption b's own target y_n[b] kept among the first B
columns and its own bank row masked: without mixup y_n[b] equals that row, so this is exactly the softmax over the Ni
images with the caption's image as the positive; with mixup the mixed target is the positive and the image it mostly
came from is not a negative (as the queue's copies are masked). Equal to `queue_infonce` with `in_batch = false` and a
queue holding each image once (tests/test_losses.py checks it).
"""
from __future__ import annotations

import torch

from latentsweep.trainers.config.tree import AllImagesInfoNCECfg
from latentsweep.trainers.losses.base import Loss, masked_ce, multipos_i2c, register_loss, unit
from latentsweep.trainers.losses.core import unique_images

BANK_KEYS = frozenset({"bank", "bank_idx"})


@register_loss("all_images_infonce")
class AllImagesInfoNCE(Loss):
    """caption->image over every image of the bank (plus image->caption over the batch's captions, multi-positive,
    when symmetric) at temperature(); label_smoothing spread over the kept columns (masked_ce)."""

    cfg: AllImagesInfoNCECfg
    cost_per_image = True  # one [batch x images] product per step

    @classmethod
    def batch_keys(cls, cfg: AllImagesInfoNCECfg) -> frozenset[str]:
        return BANK_KEYS

    def terms(self, out, batch, temperature):
        p, y, bank = unit(out["pred"]), self.target(batch), batch["bank"]  # [B, D], [B, D], [Ni, D] (same scale)
        b, arange = p.shape[0], torch.arange(p.shape[0], device=p.device)
        keep_bank = torch.ones(b, bank.shape[0], dtype=torch.bool, device=p.device)
        keep_bank[arange, batch["bank_idx"]] = False
        keep = torch.cat([torch.eye(b, dtype=torch.bool, device=p.device), keep_bank], dim=1)  # [B, B + Ni]
        tau = temperature()
        # [B, B + Ni] as two products: p @ cat([y, bank]).T copied the bank every step ([B + Ni, D], 0.13 GB at
        # challenge size) and kept the copy for the backward; the logits are the same bit for bit on the CPU
        logits = torch.cat([p @ y.T, p @ bank.T], dim=1)
        loss = masked_ce(logits / tau, keep, arange, self.cfg.label_smoothing)
        if self.cfg.symmetric:
            first, inverse = unique_images(batch["img"])
            loss = 0.5 * (loss + multipos_i2c(p @ y[first].T / tau, inverse, self.cfg.label_smoothing))
        return {"all_images_infonce": loss}
