"""Optimiser and LR-schedule registries: param groups with LR multipliers, warmup + cosine/step/plateau/constant."""
from __future__ import annotations

import math

import torch
from torch import nn

from latentsweep.trainers.config.tree import Config
from latentsweep.trainers.config.registry import Registry

OPTIMIZERS: Registry = Registry("optimizer")
SCHEDULERS: Registry = Registry("scheduler")


def param_groups(cfg: Config, model: nn.Module, extra: nn.Module | None = None) -> list[dict]:
    """One torch param group per model group (`model.param_groups()` when defined), LR = optim.lr x multiplier.

    Frozen parameters stay in their group: with requires_grad False their .grad stays None, which Adam/AdamW skip,
    so a later unfreeze needs no optimiser rebuild. `extra` (the loss state: learnable logit scale) gets its own
    group "temperature" at the base LR without weight decay: decay would pull the logit scale toward 0, i.e. tau
    toward 1, and the first model group may run at a reduced LR (the geometry model's frozen base).
    """
    groups = model.param_groups() if hasattr(model, "param_groups") else [("main", list(model.parameters()), 1.0)]
    out = [{"name": name, "params": list(params), "lr": cfg.optim.lr * mult} for name, params, mult in groups]
    if extra is not None:
        out.append({"name": "temperature", "params": list(extra.parameters()), "lr": cfg.optim.lr,
                    "weight_decay": 0.0})
    return [g for g in out if g["params"]]


def _fused(groups: list[dict]) -> bool:
    """Fused Adam kernels exist for float params on CPU and CUDA: ~4x faster steps than the per-tensor loop on CPU."""
    params = [p for g in groups for p in g["params"]]
    return bool(params) and all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)


@OPTIMIZERS.register("adam")
def _adam(groups: list[dict], cfg: Config) -> torch.optim.Optimizer:
    o = cfg.optim
    return torch.optim.Adam(groups, lr=o.lr, betas=(o.beta1, o.beta2), weight_decay=o.weight_decay,
                            fused=_fused(groups))


@OPTIMIZERS.register("adamw")
def _adamw(groups: list[dict], cfg: Config) -> torch.optim.Optimizer:
    o = cfg.optim
    return torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), weight_decay=o.weight_decay,
                             fused=_fused(groups))


@OPTIMIZERS.register("sgd")
def _sgd(groups: list[dict], cfg: Config) -> torch.optim.Optimizer:
    o = cfg.optim
    return torch.optim.SGD(groups, lr=o.lr, momentum=o.beta1, nesterov=o.beta1 > 0, weight_decay=o.weight_decay)


# ReduceLROnPlateau's mode for each value train.monitor may name.
MONITOR_MODES = {"val/mrr": "max", "val/loss": "min"}


class Schedule:
    """Uniform face of every schedule: the loop calls after_step() each batch and after_epoch(value) each epoch with
    the value of train.monitor."""

    def __init__(self, per_step=None, per_epoch=None):
        self.per_step, self.per_epoch = per_step, per_epoch

    def after_step(self) -> None:
        if self.per_step is not None:
            self.per_step.step()

    def after_epoch(self, val_metric: float) -> None:
        if isinstance(self.per_epoch, torch.optim.lr_scheduler.ReduceLROnPlateau):
            self.per_epoch.step(val_metric)
        elif self.per_epoch is not None:
            self.per_epoch.step()


def linear_warmup(step: int, warmup_steps: int) -> float:
    """The one linear warm-up: LR multiplier (step + 1) / warmup_steps at 0-based `step`, reaching 1 on the last
    warm-up step and staying there; 1 throughout when warmup_steps is 0."""
    return min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else 1.0


def _warmup_then(after, warmup_steps: int):
    """LR multiplier of step `step`: linear warm-up over `warmup_steps`, then `after(step)`."""

    def factor(step: int) -> float:
        return linear_warmup(step, warmup_steps) if step < warmup_steps else after(step)

    return factor


def _warmup_steps(cfg: Config, steps_per_epoch: int) -> int:
    return int(round(cfg.schedule.warmup_epochs * steps_per_epoch))


def _warmup_then_shape(opt, cfg: Config, steps_per_epoch: int, shape) -> torch.optim.lr_scheduler.LambdaLR:
    """Warm-up, then `shape(t)` for t in [0, 1] over the remaining steps of training."""
    total = cfg.train.epochs * steps_per_epoch
    warmup = _warmup_steps(cfg, steps_per_epoch)
    factor = _warmup_then(lambda step: shape(min(1.0, (step - warmup) / max(1, total - warmup))), warmup)
    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


@SCHEDULERS.register("cosine")
def _cosine(opt, cfg: Config, steps_per_epoch: int) -> Schedule:
    floor = cfg.schedule.min_lr_ratio  # BigJump decays to 0.1x; the VSE++ team to 0
    shape = lambda t: floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t))  # noqa: E731
    return Schedule(per_step=_warmup_then_shape(opt, cfg, steps_per_epoch, shape))


@SCHEDULERS.register("constant")
def _constant(opt, cfg: Config, steps_per_epoch: int) -> Schedule:
    return Schedule(per_step=_warmup_then_shape(opt, cfg, steps_per_epoch, lambda t: 1.0))


@SCHEDULERS.register("step")
def _step(opt, cfg: Config, steps_per_epoch: int) -> Schedule:
    s = cfg.schedule
    # LambdaLR recomputes lr from the base each step, so the step decay lives inside the same lambda
    decay = lambda step: s.gamma ** (step // (s.step_epochs * steps_per_epoch))  # noqa: E731
    factor = _warmup_then(decay, _warmup_steps(cfg, steps_per_epoch))
    return Schedule(per_step=torch.optim.lr_scheduler.LambdaLR(opt, factor))


class _ManualWarmup:
    """Linear warmup that rescales group LRs in place, so it composes with ReduceLROnPlateau.

    Each step multiplies by new/old warmup factor instead of writing target x factor: a plateau reduction made
    while warmup is still running (warmup longer than patience + 1 epochs) is kept, not overwritten.
    """

    def __init__(self, opt: torch.optim.Optimizer, warmup_steps: int):
        self.opt, self.warmup, self.count, self.factor = opt, warmup_steps, 0, 1.0
        self._apply()

    def _apply(self) -> None:
        if self.count <= self.warmup and self.warmup > 0:
            factor = linear_warmup(self.count, self.warmup)
            for group in self.opt.param_groups:
                group["lr"] *= factor / self.factor
            self.factor = factor

    def step(self) -> None:
        self.count += 1
        self._apply()


@SCHEDULERS.register("plateau")
def _plateau(opt, cfg: Config, steps_per_epoch: int) -> Schedule:
    s = cfg.schedule
    warmup = _ManualWarmup(opt, _warmup_steps(cfg, steps_per_epoch))
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(
        opt, mode=MONITOR_MODES[cfg.train.monitor], factor=s.plateau_factor, patience=s.plateau_patience
    )
    return Schedule(per_step=warmup, per_epoch=plateau)


def build_optimizer(cfg: Config, model: nn.Module, extra: nn.Module | None, steps_per_epoch: int):
    """(optimizer, Schedule) from the registries named in cfg.optim.name / cfg.schedule.name."""
    opt = OPTIMIZERS.get(cfg.optim.name)(param_groups(cfg, model, extra), cfg)
    return opt, SCHEDULERS.get(cfg.schedule.name)(opt, cfg, steps_per_epoch)
