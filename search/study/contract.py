"""What a trial hands the pick: the one contract between the search (search/study/objective.py writes it) and its
readers (search/pick/candidates.py finds the trial's checkpoint; search/study/worker.py closes a dead trial's run).

Stored as Optuna user attrs under the field names, the names studies have always used, so a study written before
this module existed reads the same. Like trainers.cost.Timing: one frozen dataclass and its codec (as_attrs /
from_attrs), so no caller spells an attribute name."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Mapping


@dataclass(frozen=True)
class TrialOutputs:
    """What one trial left behind. The run and the folder are recorded when the trial starts (a pruned or failed
    trial has them); the checkpoint and best epoch when it completes. Paths are relative to the state directory (or
    absolute when outside it), so a moved state directory still finds them."""
    mlflow_run_id: str | None = None  # the trial's MLflow run (absent when its worker died before opening it)
    out_dir: str | None = None  # its trial-N folder: config.toml, metrics.csv and the best epoch's best.pt
    checkpoint: str | None = None  # best.pt of a complete trial
    best_epoch: int | None = None  # the epoch whose checkpoint best.pt holds (complete trials)

    def as_attrs(self) -> dict:
        """The fields that are set, as JSON-able user attrs."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    @classmethod
    def from_attrs(cls, attrs: Mapping) -> "TrialOutputs":
        """The outputs recorded in a trial's user attrs; a missing or mistyped value reads as None (another
        attribute, or a study written by hand, cannot break the reader)."""
        return cls(**{name: _typed(attrs.get(name), kind) for name, kind in KINDS.items()})

    @classmethod
    def of(cls, trial) -> "TrialOutputs":
        """The outputs of an Optuna trial (FrozenTrial or a live Trial)."""
        return cls.from_attrs(trial.user_attrs)

    def record(self, trial) -> None:
        """Write the fields that are set on a live Optuna trial (the others stay as they were)."""
        for name, value in self.as_attrs().items():
            trial.set_user_attr(name, value)

    @property
    def local_checkpoint(self) -> str | None:
        """Where the trial's best.pt is on disk: the completed trial's checkpoint, else its folder's best.pt (a
        pruned trial records no checkpoint, but kept its best epoch's); None when neither was recorded."""
        return self.checkpoint or (f"{self.out_dir}/best.pt" if self.out_dir else None)


KINDS = {"mlflow_run_id": str, "out_dir": str, "checkpoint": str, "best_epoch": int}


def _typed(value, kind: type):
    return value if isinstance(value, kind) and not isinstance(value, bool) else None


__all__ = ["TrialOutputs"]
