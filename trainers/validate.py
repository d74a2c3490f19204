"""Whole-config checks that need the registries (names exist, cross-knob constraints), run before any training."""
from __future__ import annotations

from dataclasses import fields

from trainers.config import Config
from trainers.errors import ConfigError

# Losses that read per-image labels (the multilabel task) rather than paired image embeddings.
LABEL_LOSSES = {"multilabel_triplet"}


def validate(cfg: Config) -> None:
    """Raise ConfigError (one line) for a config that cannot train; the registries name the closest valid choice."""
    from trainers import losses
    from trainers.models import MODELS
    from trainers.optim import OPTIMIZERS, SCHEDULERS
    from trainers.tasks import TASKS

    MODELS.get(cfg.model.kind)
    OPTIMIZERS.get(cfg.optim.name)
    SCHEDULERS.get(cfg.schedule.name)
    TASKS.get(cfg.data.task)
    losses.validate(cfg)
    if cfg.data.split == "kfold" and cfg.data.fold >= cfg.data.n_folds:
        raise ConfigError(f"data.fold={cfg.data.fold} must be < data.n_folds={cfg.data.n_folds}")
    if cfg.schedule.warmup_epochs > cfg.train.epochs:
        raise ConfigError(
            f"schedule.warmup_epochs={cfg.schedule.warmup_epochs} exceeds train.epochs={cfg.train.epochs}"
        )
    active = {f.name for f in fields(cfg.loss) if getattr(cfg.loss, f.name).weight > 0}
    if cfg.data.task == "translate" and active & LABEL_LOSSES:
        raise ConfigError(f"loss.{sorted(active & LABEL_LOSSES)[0]} needs data.task='multilabel'")
    if cfg.data.task == "multilabel" and active - LABEL_LOSSES:
        raise ConfigError(
            f"data.task='multilabel' trains with {', '.join(sorted(LABEL_LOSSES))} only; "
            f"set loss.{sorted(active - LABEL_LOSSES)[0]}.weight = 0"
        )
