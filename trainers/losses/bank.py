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
from torch.autograd.function import once_differentiable

from latentsweep.trainers.config.tree import AllImagesInfoNCECfg
from latentsweep.trainers.losses.base import MASKED, Loss, multipos_i2c, register_loss, unit
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
        tau = temperature()
        loss = BankCE.apply(p, y.float(), bank.float(), batch["bank_idx"], tau, float(self.cfg.label_smoothing))
        if self.cfg.symmetric:
            first, inverse = unique_images(batch["img"])
            loss = 0.5 * (loss + multipos_i2c(p @ y[first].T / tau, inverse, self.cfg.label_smoothing))
        return {"all_images_infonce": loss}


class BankCE(torch.autograd.Function):
    """masked_ce over the logits [B, 1 + Ni] of each caption: its own target y[b] (the positive) and every bank row
    but its own image's (bank_idx[b]), at temperature tau; label smoothing over those Ni kept columns.

    Why not masked_ce on `torch.cat([p @ y.T, p @ bank.T]) / tau`: autograd kept four [B, B + Ni] blocks for the
    backward or beside it (the product, its scaled copy, the masked copy, the log-softmax; 42 MB each at B = 512 and
    Ni = 20,000, the challenge's training images) and made as many again in the backward. This keeps one, the
    softmax over the bank [B, Ni], and turns it into the logits' gradient in place: the same values to float rounding
    (tests/test_losses.py checks both against the masked_ce form). Of p @ y.T only its diagonal is ever kept, so only
    the diagonal is computed. Float32 throughout (losses run with autocast off)."""

    @staticmethod
    def forward(ctx, p, y, bank, bank_idx, tau, smoothing):
        rows = torch.arange(p.shape[0], device=p.device)
        own = (p * y).sum(1) / tau  # [B] the positive's logit
        z = torch.mm(p, bank.T).div_(tau)  # [B, Ni]
        n = bank.shape[0]  # kept columns a row: its positive and the bank less its own image
        kept_sum = own + z.sum(1) - z[rows, bank_idx] if smoothing else None  # [B] the kept logits' sum
        z[rows, bank_idx] = MASKED
        top = torch.maximum(z.amax(1), own)  # [B]
        e = z.sub_(top[:, None]).exp_()  # [B, Ni] exp(z - top), in place
        total = e.sum(1) + torch.exp(own - top)
        lse = total.log() + top  # [B]
        prob = e.div_(total[:, None])  # [B, Ni] the softmax over the bank, in place
        loss = lse - own if not smoothing else (1.0 - smoothing) * (lse - own) + smoothing * (lse - kept_sum / n)
        ctx.save_for_backward(p, y, bank, bank_idx, tau, prob, own, lse, kept_sum)
        ctx.smoothing, ctx.n = smoothing, n
        return loss.mean()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        p, y, bank, bank_idx, tau, prob, own, lse, kept_sum = ctx.saved_tensors
        eps, n, b = ctx.smoothing, ctx.n, p.shape[0]
        rows = torch.arange(b, device=p.device)
        p_own = torch.exp(own - lse)  # [B] the positive's probability
        grad_tau = None
        if ctx.needs_input_grad[4]:
            # sum_j G_bj z_bj, with sum_j P_bj z_bj = sum_j P_bj log P_bj + lse (the P sum to 1; an underflowed P is 0
            # either way), so the logits need not be kept
            pz = torch.special.xlogy(prob, prob).sum(1) + torch.special.xlogy(p_own, p_own) + lse
            gz = pz - (1.0 - eps) * own - (eps * kept_sum / n if eps else 0.0)
            grad_tau = -(grad / b) * gz.sum() / tau
        c = grad / (b * tau)  # d loss / d logit, per unit of (P - target), through z = p.k / tau
        g_bank = prob.sub_(eps / n) if eps else prob  # [B, Ni] in place: the saved softmax is not read again
        g_bank[rows, bank_idx] = 0.0
        g_bank.mul_(c)
        g_own = (p_own - (1.0 - eps) - eps / n) * c  # [B]
        grad_p = torch.mm(g_bank, bank).add_(g_own[:, None] * y) if ctx.needs_input_grad[0] else None
        grad_y = g_own[:, None] * p if ctx.needs_input_grad[1] else None
        return grad_p, grad_y, None, None, grad_tau, None
