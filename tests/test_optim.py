"""Tests of the optimiser and LR-schedule registries: the LR curve of every schedule and per-group LR multipliers."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from latentsweep.trainers.config.tree import Config, with_values
from latentsweep.trainers.train.optim import OPTIMIZERS, SCHEDULERS, build_optimizer, param_groups

# Schedulers with a curve test below; a newly registered one must get its own.
CURVE_TESTED = {"cosine", "constant", "step", "plateau"}


class TwoGroups(nn.Module):
    """A model whose param_groups() gives a body at LR x 1.0 and a head at LR x 0.1."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def param_groups(self):
        return [("body", list(self.body.parameters()), 1.0), ("head", list(self.head.parameters()), 0.1)]


class Extra(nn.Module):
    """Stands in for the loss state's learnable logit scale."""

    def __init__(self):
        super().__init__()
        self.logit_scale = nn.Parameter(torch.zeros(()))


def cfg_of(**values) -> Config:
    return with_values(Config(), {"optim.lr": 1.0, "schedule.warmup_epochs": 0.0, **values})


def run_steps(opt, schedule, n: int) -> list[list[float]]:
    """LR of every group as used by each of `n` optimiser steps (read before the step, as the loop applies it)."""
    used = []
    for _ in range(n):
        used.append([g["lr"] for g in opt.param_groups])
        opt.step()  # no gradients: parameters unchanged, but the scheduler sees a real optimizer step
        schedule.after_step()
    return used


# ---------------------------------------------------------------------------------------------- registries

def test_every_scheduler_has_a_curve_test():
    assert set(SCHEDULERS.names()) == CURVE_TESTED


@pytest.mark.parametrize("name, cls", [("adam", torch.optim.Adam), ("adamw", torch.optim.AdamW),
                                       ("sgd", torch.optim.SGD)])
def test_optimizers_take_their_settings(name, cls):
    cfg = with_values(Config(), {"optim.name": name, "optim.lr": 0.01, "optim.weight_decay": 0.05,
                                 "optim.beta1": 0.8, "optim.beta2": 0.95})
    opt, _ = build_optimizer(cfg, TwoGroups(), None, steps_per_epoch=1)
    assert isinstance(opt, cls)
    group = opt.param_groups[0]
    assert group["weight_decay"] == 0.05
    if name == "sgd":
        assert group["momentum"] == 0.8 and group["nesterov"]
    else:
        assert group["betas"] == (0.8, 0.95)


def test_unknown_names_suggest_closest():
    from latentsweep.trainers.core.errors import ConfigError

    with pytest.raises(ConfigError, match="did you mean 'adamw'"):
        build_optimizer(with_values(Config(), {"optim.name": "adamww"}), TwoGroups(), None, 1)
    with pytest.raises(ConfigError, match="did you mean 'cosine'"):
        build_optimizer(with_values(Config(), {"schedule.name": "cosin"}), TwoGroups(), None, 1)


def test_param_groups_default_and_extra():
    model = nn.Linear(3, 3)
    groups = param_groups(cfg_of(**{"optim.lr": 0.5}), model, Extra())
    assert [(g["name"], g["lr"], len(g["params"])) for g in groups] == [("main", 0.5, 2), ("temperature", 0.5, 1)]

    groups = param_groups(cfg_of(**{"optim.lr": 0.5}), TwoGroups(), Extra())
    assert [(g["name"], g["lr"]) for g in groups] == [("body", 0.5), ("head", 0.05), ("temperature", 0.5)]
    assert len(groups[0]["params"]) == 2 and len(groups[1]["params"]) == 2


class FrozenBaseFirst(nn.Module):
    """Like the geometry model: its first group is the closed-form base at LR x 0.05."""

    def __init__(self):
        super().__init__()
        self.base = nn.Linear(4, 4)
        self.adapter = nn.Linear(4, 4)

    def param_groups(self):
        return [("base", list(self.base.parameters()), 0.05), ("adapter", list(self.adapter.parameters()), 1.0)]


@pytest.mark.parametrize("name", ["adam", "adamw", "sgd"])
def test_temperature_group_has_base_lr_and_no_weight_decay(name):
    cfg = cfg_of(**{"optim.name": name, "optim.lr": 0.1, "optim.weight_decay": 0.5, "schedule.name": "constant"})
    extra = Extra()
    opt, _ = build_optimizer(cfg, FrozenBaseFirst(), extra, steps_per_epoch=1)
    temp = next(g for g in opt.param_groups if g["name"] == "temperature")
    assert temp["lr"] == pytest.approx(0.1) and temp["weight_decay"] == 0.0
    assert temp["params"] == [extra.logit_scale]
    assert opt.param_groups[0]["weight_decay"] == 0.5  # the model groups keep theirs
    with torch.no_grad():
        extra.logit_scale.fill_(3.0)
    extra.logit_scale.grad = torch.zeros(())  # no loss gradient: only weight decay could move it
    opt.step()
    assert float(extra.logit_scale.detach()) == 3.0


# ---------------------------------------------------------------------------------------------- curves

def test_cosine_warmup_then_decay_to_floor():
    epochs, spe = 5, 4  # 20 steps: 4 warmup steps, then 16 of cosine
    cfg = cfg_of(**{"schedule.name": "cosine", "schedule.warmup_epochs": 1.0, "schedule.min_lr_ratio": 0.1,
                    "train.epochs": epochs})
    opt, schedule = build_optimizer(cfg, nn.Linear(2, 2), None, spe)
    lrs = [g[0] for g in run_steps(opt, schedule, epochs * spe)]
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])  # linear warmup
    assert lrs[4] == pytest.approx(1.0)  # cosine starts at the peak
    assert all(a > b for a, b in zip(lrs[4:], lrs[5:]))  # strictly decreasing after warmup
    assert lrs[12] == pytest.approx(0.1 + 0.9 * 0.5)  # half-way (t = 8/16): floor + half the span
    assert lrs[-1] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 15 / 16)))
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)  # after the last step: min_lr_ratio x lr


def test_cosine_without_floor_ends_at_zero():
    cfg = cfg_of(**{"schedule.name": "cosine", "train.epochs": 2})
    opt, schedule = build_optimizer(cfg, nn.Linear(2, 2), None, 3)
    lrs = [g[0] for g in run_steps(opt, schedule, 6)]
    assert lrs[0] == pytest.approx(1.0)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)


def test_constant_after_warmup():
    cfg = cfg_of(**{"schedule.name": "constant", "schedule.warmup_epochs": 0.5, "train.epochs": 3})
    opt, schedule = build_optimizer(cfg, nn.Linear(2, 2), None, 4)
    lrs = [g[0] for g in run_steps(opt, schedule, 12)]
    assert lrs == pytest.approx([0.5, 1.0] + [1.0] * 10)


def test_step_decays_by_gamma_every_step_epochs():
    spe = 3
    cfg = cfg_of(**{"schedule.name": "step", "schedule.step_epochs": 2, "schedule.gamma": 0.5, "train.epochs": 7})
    opt, schedule = build_optimizer(cfg, nn.Linear(2, 2), None, spe)
    lrs = [g[0] for g in run_steps(opt, schedule, 7 * spe)]
    per_epoch = [lrs[e * spe: (e + 1) * spe] for e in range(7)]
    expected = [1.0, 1.0, 0.5, 0.5, 0.25, 0.25, 0.125]
    for epoch, (values, want) in enumerate(zip(per_epoch, expected)):
        assert values == pytest.approx([want] * spe), epoch


def test_step_ignores_epoch_metric():
    cfg = cfg_of(**{"schedule.name": "step", "train.epochs": 3})
    opt, schedule = build_optimizer(cfg, nn.Linear(2, 2), None, 2)
    for score in (0.5, 0.1, 0.0):
        run_steps(opt, schedule, 2)
        schedule.after_epoch(score)
    assert opt.param_groups[0]["lr"] == pytest.approx(1.0)


def test_plateau_reduces_after_patience_bad_epochs():
    cfg = cfg_of(**{"schedule.name": "plateau", "schedule.plateau_patience": 2, "schedule.plateau_factor": 0.5,
                    "train.epochs": 10})
    opt, schedule = build_optimizer(cfg, nn.Linear(2, 2), None, 2)
    lrs = []
    for score in (0.1, 0.2, 0.3, 0.3, 0.25, 0.3, 0.2, 0.1, 0.1):  # val/mrr: higher is better
        run_steps(opt, schedule, 2)
        schedule.after_epoch(score)
        lrs.append(opt.param_groups[0]["lr"])
    # Improving epochs never reduce; the 3rd non-improving epoch in a row (> patience 2) halves the LR, and the
    # counter restarts: three more bad epochs are needed for the next halving.
    assert lrs == pytest.approx([1.0, 1.0, 1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.25])


def test_plateau_on_val_loss_reduces_when_the_loss_stops_falling():
    cfg = cfg_of(**{"schedule.name": "plateau", "schedule.plateau_patience": 1, "schedule.plateau_factor": 0.5,
                    "train.epochs": 10, "train.monitor": "val/loss"})
    opt, schedule = build_optimizer(cfg, nn.Linear(2, 2), None, 2)
    lrs = []
    for loss in (3.0, 2.0, 1.0, 1.5, 1.4, 0.5):  # val/loss: lower is better
        run_steps(opt, schedule, 2)
        schedule.after_epoch(loss)
        lrs.append(opt.param_groups[0]["lr"])
    # falling losses never reduce (a val/mrr monitor would have halved here); two epochs above 1.0 do
    assert lrs == pytest.approx([1.0, 1.0, 1.0, 1.0, 0.5, 0.5])


def test_plateau_warmup_reaches_the_peak():
    cfg = cfg_of(**{"schedule.name": "plateau", "schedule.warmup_epochs": 1.0, "train.epochs": 3})
    opt, schedule = build_optimizer(cfg, nn.Linear(2, 2), None, 4)
    lrs = [g[0] for g in run_steps(opt, schedule, 8)]
    assert lrs == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0, 1.0])


def test_plateau_reduction_during_warmup_is_kept():
    # Warmup over 3 epochs, patience 0: epoch 1 is worse than epoch 0, so the LR halves while warmup still runs.
    spe = 2
    cfg = cfg_of(**{"schedule.name": "plateau", "schedule.warmup_epochs": 3.0, "schedule.plateau_patience": 0,
                    "schedule.plateau_factor": 0.5, "train.epochs": 5})
    opt, schedule = build_optimizer(cfg, nn.Linear(2, 2), None, spe)
    for score in (0.5, 0.4, 0.6):
        run_steps(opt, schedule, spe)
        schedule.after_epoch(score)
    run_steps(opt, schedule, 2 * spe)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5)  # the peak is half the target, not the target


# ---------------------------------------------------------------------------------------------- multipliers

SCHEDULE_SETTINGS = {
    "cosine": {"schedule.warmup_epochs": 1.0, "schedule.min_lr_ratio": 0.1},
    "constant": {"schedule.warmup_epochs": 1.0},
    "step": {"schedule.warmup_epochs": 1.0, "schedule.step_epochs": 1, "schedule.gamma": 0.5},
    "plateau": {"schedule.warmup_epochs": 1.0, "schedule.plateau_patience": 0},
}


@pytest.mark.parametrize("name", SCHEDULERS.names())
@pytest.mark.parametrize("optimizer", OPTIMIZERS.names())
def test_group_multipliers_are_kept(name, optimizer):
    cfg = cfg_of(**{"schedule.name": name, "optim.name": optimizer, "optim.lr": 0.01, "train.epochs": 4,
                    **SCHEDULE_SETTINGS.get(name, {})})
    opt, schedule = build_optimizer(cfg, TwoGroups(), Extra(), steps_per_epoch=3)
    assert [g["name"] for g in opt.param_groups] == ["body", "head", "temperature"]
    body_lrs = []
    for score in (0.5, 0.4, 0.3, 0.2):  # worsening: the plateau schedule reduces too
        for body, head, temperature in run_steps(opt, schedule, 3):
            assert head == pytest.approx(0.1 * body, rel=1e-9)
            assert temperature == pytest.approx(body, rel=1e-9)
            body_lrs.append(body)
        schedule.after_epoch(score)
    assert len(set(body_lrs)) > 1  # the schedule did change the LR, so the ratio was tested under change
    assert max(body_lrs) == pytest.approx(0.01)
