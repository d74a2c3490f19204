"""Criterion: the active losses with their weights and the shared Temperature, the one loss module the loop calls."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from latentsweep.trainers.config.tree import Config
from latentsweep.trainers.losses.base import LOSSES, EpochContext, known_unit, zero_like
from latentsweep.trainers.losses.temperature import Temperature


def active_losses(cfg: Config) -> list[str]:
    """Registry names of the losses with weight > 0, in registry (= summation) order."""
    return [name for name in LOSSES.names() if float(getattr(cfg.loss, name).weight) > 0]


def batch_keys(cfg: Config) -> frozenset[str]:
    """Extra batch entries the active losses read (their `batch_keys` declarations), for the task to supply."""
    keys: frozenset[str] = frozenset()
    for name in active_losses(cfg):
        keys |= LOSSES.get(name).batch_keys(getattr(cfg.loss, name))
    return keys


class Criterion(nn.Module):
    """`criterion(out, batch) -> (total, {term: detached value})`; built once per run as `Criterion(cfg, dim_out)`.

    total = sum over the active losses (weight > 0, a ModuleDict in registry order) of weight * sum(its terms).
    The loop drives the hooks through it: `on_epoch_start(epoch, ctx)`, `after_step(out, real_batch)` and
    `set_progress(p)` (the temperature curriculum); `log_values()` adds train/tau when tau moves.

    `state_dict()` is the loss state a checkpoint keeps: the temperature's logit scale (plus any persistent loss
    buffer; the queue's are non-persistent, see trainers/losses/queue.py). Checkpoints written before the criterion
    existed saved `{"logit_scale": ...}`; loading renames that key to `temperature.logit_scale`.
    """

    def __init__(self, cfg: Config, dim_out: int):
        super().__init__()
        self.temperature = Temperature(cfg.temperature)
        self.losses = nn.ModuleDict({name: LOSSES.get(name)(getattr(cfg.loss, name), dim_out, cfg.loss.targets)
                                     for name in active_losses(cfg)})
        self.weights = {name: float(getattr(cfg.loss, name).weight) for name in self.losses}
        self.out_norm = cfg.model.out_norm
        self.register_load_state_dict_pre_hook(_rename_legacy_keys)

    @property
    def cost_per_image(self) -> bool:
        """Whether a step's cost grows with the number of training images (an active loss over every image)."""
        return any(loss.cost_per_image for loss in self.losses.values())

    def forward(self, out: dict, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if torch.compiler.is_compiling():
            # A captured step (train.capture): dynamo cannot trace the ContextVar of known_unit (a graph break that
            # dropped this whole frame from the graph), so there `unit` normalises every input again, which the
            # compiled graph fuses; the values agree to float32 rounding (tests/test_capture.py).
            return self._total(out, batch)
        with known_unit(self._known_unit(out, batch)):
            return self._total(out, batch)

    def _total(self, out: dict, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        total: torch.Tensor | None = None
        logged: dict[str, torch.Tensor] = {}
        for name, loss in self.losses.items():
            weight = self.weights[name]
            for key, value in loss(out, batch, self.temperature).items():
                total = weight * value if total is None else total + weight * value
                logged[key] = value.detach()
        return (zero_like(out["pred"]) if total is None else total), logged

    def _known_unit(self, out: dict, batch: dict) -> tuple[torch.Tensor, ...]:
        """y_n is unit by the batch contract, pred by the model contract when model.out_norm; float32 only (a half
        precision pred re-normalised in float32 differs)."""
        known = [batch.get("y_n"), out["pred"] if self.out_norm else None]
        return tuple(t for t in known if t is not None and t.dtype == torch.float32)

    def on_epoch_start(self, epoch: int, ctx: EpochContext | None = None) -> None:
        for loss in self.losses.values():
            loss.on_epoch_start(epoch, ctx)

    def after_step(self, out: dict, batch: dict) -> None:
        """After the optimiser step; `batch` is the real (un-augmented) batch, which is what the queue keeps."""
        for loss in self.losses.values():
            loss.after_step(out, batch)

    def set_progress(self, progress: float) -> None:
        """Training progress in [0, 1] over the whole run (epoch + step fraction) / epochs."""
        self.temperature.progress = progress

    def log_values(self) -> dict[str, float]:
        return self.temperature.log_values()


def _rename_legacy_keys(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """A pre-criterion checkpoint's loss state: {"logit_scale"} at the top, now the temperature's."""
    if prefix + "logit_scale" in state_dict:
        state_dict[prefix + "temperature.logit_scale"] = state_dict.pop(prefix + "logit_scale")
