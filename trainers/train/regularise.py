"""Regularisers outside the losses: batch augmentation (embedding mixup, input noise) and weight averaging (EMA, SWA).

`BatchAugment` is applied by the loop to every training batch (never to validation). `WEIGHT_AVERAGES` holds the
weight-averaging rules (none, ema, swa): the loop updates the averager after every optimiser step and every epoch,
then validates and checkpoints `averager.model(live)` - the averaged copy when one is on, else the live model.
"""
from __future__ import annotations

import copy
import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from latentsweep.trainers.config.tree import Config
from latentsweep.trainers.config.registry import Registry
from latentsweep.trainers.data.rows import Rows, column_stat

WEIGHT_AVERAGES: Registry = Registry("weight average (train.average)")


class BatchAugment:
    """Embedding mixup then Gaussian input noise on a training batch; the identity (same dict) when both are off.

    Own random generators seeded from train.seed, so the data order (the loop's generator) is the same with the
    augmentation on or off, and off consumes nothing: training is bit-identical to a build without this module.

    Mixup (Zhang et al. 2018, on embeddings): one lambda ~ Beta(alpha, alpha) per batch and a random pairing
    `perm` of the rows; every row becomes row i mixed with row perm[i]:
      x   <- lam x   + (1 - lam) x[perm]         (model input [B, Dt])
      y   <- lam y   + (1 - lam) y[perm]         (raw image target [B, Di], read by mse)
      y_n <- normalise(lam y_n + (1 - lam) y_n[perm])   (unit target [B, Di], read by every cosine loss)
      img <- a fresh id per distinct mixed target (rows whose mixed targets are equal share one id)
    The mixed pair is its own "image": every translation loss (InfoNCE, multi-positive, queue, triplet, slots,
    cosine, moment, agreement, mse) then sees a consistent (input, target, same-image mask) triple and needs no
    change. Soft InfoNCE targets were rejected because they do not exist for triplet, cosine or mse.
    The queue keeps the real (unmixed) images: the loop enqueues from its own batch, not the augmented one.

    Noise: x <- x + noise_std * sigma * N(0, 1), sigma [Dt] the per-dimension std of the training inputs. The std
    is relative because caption embeddings are not normalised and their scale depends on the encoder (RoBERTa and
    e5 norms differ by an order of magnitude), so one searched range fits every dataset; per dimension, so a
    near-constant coordinate is not swamped by noise sized for the others.
    """

    def __init__(self, cfg: Config, train_x: torch.Tensor | Rows):
        aug, seed = cfg.augment, cfg.train.seed
        self.alpha, self.noise_std = aug.mixup_alpha, aug.noise_std
        self.rng = np.random.default_rng(seed)  # lambda draws
        self.gen = torch.Generator(device=train_x.device).manual_seed(seed)  # pairings and noise, on the device
        self.sigma = column_stat(train_x, lambda x: x.float().std(dim=0)) if self.noise_std > 0 else None  # [Dt]

    @property
    def active(self) -> bool:
        return self.alpha > 0 or self.noise_std > 0

    def __call__(self, batch: dict) -> dict:
        if not self.active:
            return batch
        batch = dict(batch)
        if self.alpha > 0:
            batch.update(self._mixup(batch))
        if self.noise_std > 0:
            x = batch["x"]
            noise = torch.randn(x.shape, generator=self.gen, device=x.device, dtype=torch.float32)
            batch["x"] = x + (self.noise_std * self.sigma * noise).to(x.dtype)
        return batch

    def _mixup(self, batch: dict) -> dict:
        lam = float(self.rng.beta(self.alpha, self.alpha))
        x = batch["x"]
        perm = torch.randperm(x.shape[0], generator=self.gen, device=x.device)
        y_n = F.normalize(lam * batch["y_n"] + (1.0 - lam) * batch["y_n"][perm], dim=-1)
        _, img = torch.unique(y_n, dim=0, return_inverse=True)  # [B] one id per distinct mixed target
        return {"x": lam * x + (1.0 - lam) * x[perm], "y": lam * batch["y"] + (1.0 - lam) * batch["y"][perm],
                "y_n": y_n, "img": img}


class WeightAverage:
    """No averaging: validation and the checkpoint use the live weights."""

    def __init__(self, cfg: Config, model: nn.Module):
        self.cfg = cfg

    def after_step(self) -> None:
        """Called after every optimiser step."""

    def rebind(self, model: nn.Module) -> None:
        """The live model's tensors moved (latentsweep.trainers.train.stack): nothing is paired without an average."""

    def after_epoch(self, epoch: int) -> None:
        """Called after every training epoch, before validation."""

    def model(self, live: nn.Module) -> nn.Module:
        """The model to validate and checkpoint."""
        return live


WEIGHT_AVERAGES.register("none")(WeightAverage)


class _Averaged(WeightAverage):
    """Holds a frozen copy of the model whose floating-point state (parameters AND buffers, so BatchNorm running
    statistics are averaged alongside the weights they were measured with) is an average of the live state;
    integer buffers (BatchNorm's num_batches_tracked) are copied."""

    def __init__(self, cfg: Config, model: nn.Module):
        super().__init__(cfg, model)
        self.avg = copy.deepcopy(model).requires_grad_(False)
        self.n = 0  # live states averaged so far
        self.rebind(model)

    def rebind(self, model: nn.Module) -> None:
        """Pair the average with the live state. The live tensors are updated in place (optimiser steps,
        load_state_dict), so this is done once, and again only when they move (latentsweep.trainers.train.stack
        re-stacks a
        population's members)."""
        pairs = list(zip(self.avg.state_dict().values(), model.state_dict().values()))
        self.floats = [[a for a, _ in pairs if a.is_floating_point()], [b for a, b in pairs if a.is_floating_point()]]
        self.others = [(a, b) for a, b in pairs if not a.is_floating_point()]

    @torch.no_grad()
    def _blend(self, weight: float) -> None:
        """avg <- avg + weight * (live - avg) for every floating entry of the state dict; copy the others."""
        # One fused op over every tensor. Underscored but it is what torch.optim.swa_utils itself calls (no public
        # multi-tensor lerp exists); tests/test_torch_api.py checks that the installed torch still has it.
        torch._foreach_lerp_(self.floats[0], self.floats[1], weight)
        for a, b in self.others:
            a.copy_(b)
        self.n += 1


@WEIGHT_AVERAGES.register("ema")
class EMA(_Averaged):
    """Exponential moving average per optimiser step, avg <- d * avg + (1 - d) * live, from the initial weights,
    validated from the first epoch on. d = min(ema_decay, (1 + n) / (10 + n)) after n updates: the warm-up of
    TensorFlow's ExponentialMovingAverage(num_updates), so a decay chosen for long runs (0.999 spans ~1000 steps)
    does not leave a short run's average (the demo data has ~18 steps per epoch) stuck near the random init."""

    def decay(self) -> float:
        return min(self.cfg.train.ema_decay, (1.0 + self.n) / (10.0 + self.n))

    def after_step(self) -> None:
        self._blend(1.0 - self.decay())

    def model(self, live: nn.Module) -> nn.Module:
        return self.avg


@WEIGHT_AVERAGES.register("swa")
class SWA(_Averaged):
    """Stochastic weight averaging (Izmailov et al. 2018): the uniform mean of the end-of-epoch weights from epoch
    floor(swa_start * train.epochs) on; before that epoch the live model is validated. BatchNorm statistics are the
    mean of the averaged epochs' statistics rather than recomputed (torch's update_bn), which costs a data pass."""

    def start_epoch(self) -> int:
        return math.floor(self.cfg.train.swa_start * self.cfg.train.epochs)

    def after_epoch(self, epoch: int) -> None:
        if epoch >= self.start_epoch():
            self._blend(1.0 / (self.n + 1))

    def model(self, live: nn.Module) -> nn.Module:
        return self.avg if self.n > 0 else live


def build_average(cfg: Config, model: nn.Module) -> WeightAverage:
    return WEIGHT_AVERAGES.get(cfg.train.average)(cfg, model)
