"""Whole-config checks that need the registries (names exist, cross-knob constraints), run before any training."""
from __future__ import annotations

import re
from dataclasses import fields

from trainers.config import Config
from trainers.errors import ConfigError

# Losses that read per-image labels (the multilabel task) rather than paired image embeddings.
LABEL_LOSSES = {"multilabel_triplet"}
# What train.device and `pick --device` accept besides auto (torch.device parses far more, e.g. 'meta' or 'xla').
DEVICE_NAME = re.compile(r"cpu|cuda(:[0-9]{1,4})?")


def validate(cfg: Config) -> None:
    """Raise ConfigError (one line) for a config that cannot train; the registries name the closest valid choice."""
    from trainers import losses
    from trainers.models import check_model
    from trainers.optim import OPTIMIZERS, SCHEDULERS
    from trainers.regularise import WEIGHT_AVERAGES
    from trainers.tasks import TASKS

    check_model(cfg)
    OPTIMIZERS.get(cfg.optim.name)
    SCHEDULERS.get(cfg.schedule.name)
    TASKS.get(cfg.data.task)
    WEIGHT_AVERAGES.get(cfg.train.average)
    losses.validate(cfg)
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
    if cfg.augment.mixup_alpha > 0 and cfg.data.task != "translate":
        raise ConfigError("augment.mixup_alpha > 0 mixes image targets: it needs data.task='translate'")
    active = {f.name for f in fields(cfg.loss) if getattr(cfg.loss, f.name).weight > 0}
    if cfg.data.task == "translate" and active & LABEL_LOSSES:
        raise ConfigError(f"loss.{sorted(active & LABEL_LOSSES)[0]} needs data.task='multilabel'")
    if cfg.data.task == "multilabel" and active - LABEL_LOSSES:
        raise ConfigError(
            f"data.task='multilabel' trains with {', '.join(sorted(LABEL_LOSSES))} only; "
            f"set loss.{sorted(active - LABEL_LOSSES)[0]}.weight = 0"
        )
