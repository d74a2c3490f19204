"""Whole-config checks that need the registries (names exist, cross-knob constraints), run before any training.

The one home of the config cross-checks; the losses' come from what each registered loss declares (its task, the
slots it needs), not from lists of loss names.
"""
from __future__ import annotations

from latentsweep.trainers.config.tree import Config
from latentsweep.trainers.core.devices import DEVICE_NAME
from latentsweep.trainers.core.errors import ConfigError
from latentsweep.trainers.losses import LOSSES, active_losses
from latentsweep.trainers.models.zoo import UNTRAINED_KINDS, check_model
from latentsweep.trainers.train.optim import OPTIMIZERS, SCHEDULERS
from latentsweep.trainers.train.regularise import WEIGHT_AVERAGES
from latentsweep.trainers.train.tasks import TASKS


def validate(cfg: Config) -> None:
    """Raise ConfigError (one line) for a config that cannot train; the registries name the closest valid choice."""
    check_model(cfg)
    OPTIMIZERS.get(cfg.optim.name)
    SCHEDULERS.get(cfg.schedule.name)
    TASKS.get(cfg.data.task)
    WEIGHT_AVERAGES.get(cfg.train.average)
    validate_losses(cfg)
    if cfg.train.device != "auto" and not DEVICE_NAME.fullmatch(cfg.train.device):
        raise ConfigError(f"train.device='{cfg.train.device}' is not one of auto, cpu, cuda, cuda:N")
    if cfg.data.split == "kfold" and cfg.data.fold >= cfg.data.n_folds:
        raise ConfigError(f"data.fold={cfg.data.fold} must be < data.n_folds={cfg.data.n_folds}")
    if cfg.data.split == "all" and cfg.data.task != "translate":
        raise ConfigError(f"data.split='all' (no validation) is for data.task='translate', got '{cfg.data.task}'")
    if cfg.train.stop_after > cfg.train.epochs:
        raise ConfigError(f"train.stop_after={cfg.train.stop_after} exceeds train.epochs={cfg.train.epochs}")
    if cfg.schedule.warmup_epochs > cfg.train.epochs:
        raise ConfigError(
            f"schedule.warmup_epochs={cfg.schedule.warmup_epochs} exceeds train.epochs={cfg.train.epochs}"
        )
    if cfg.train.monitor == "val/loss" and cfg.data.task != "translate":
        raise ConfigError(f"train.monitor = 'val/loss' needs data.task = 'translate' (got '{cfg.data.task}')")
    if cfg.loss.targets == "raw" and cfg.data.task != "translate":
        raise ConfigError(f"loss.targets = 'raw' scales the image targets of data.task = 'translate'; "
                          f"data.task = '{cfg.data.task}' has none (set loss.targets = 'unit')")
    if cfg.augment.mixup_alpha > 0 and cfg.data.task != "translate":
        raise ConfigError("augment.mixup_alpha > 0 mixes image targets: it needs data.task='translate'")


def validate_losses(cfg: Config) -> None:
    """The loss config: at least one loss on; each active loss's declared needs (slots, task) met, and its own
    check of its section (`Loss.check`)."""
    active = active_losses(cfg)
    if not active and cfg.model.kind not in UNTRAINED_KINDS:  # a fitted-only model has no loss to train with
        raise ConfigError(f"loss: no loss has a positive weight (set one of loss.<name>.weight > 0; "
                          f"names: {', '.join(LOSSES.names())})")
    for name in active:
        if LOSSES.get(name).min_slots and cfg.slots.k == 0:
            raise ConfigError(f"loss.{name}.weight > 0 needs the slot head: set slots.k > 0")
    for name in active:
        need = LOSSES.get(name).min_slots
        if cfg.slots.k < need:
            raise ConfigError(f"loss.{name}.weight > 0 needs slots.k >= {need} (got {cfg.slots.k})")
    for name in active:
        LOSSES.get(name).check(getattr(cfg.loss, name))
    for name in active:
        task = LOSSES.get(name).task
        if task != cfg.data.task:
            raise ConfigError(f"loss.{name}.weight > 0 needs data.task = '{task}' (got '{cfg.data.task}'); "
                              f"set loss.{name}.weight = 0 or data.task = '{task}'")
