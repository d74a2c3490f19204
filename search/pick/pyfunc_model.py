"""The picked ensemble as a self-contained MLflow pyfunc model: caption embeddings [N, Dt] -> image-space [N, Di].

The members are exported with torch.export (member-NN.pt2, the model in eval mode returning its "pred" output) next
to ensemble.json (names, weights); the model code is search/pick/pyfunc_standalone.py, saved into the model, which
needs numpy, torch and mlflow only: the model loads and predicts where latentsweep is not installed. It accepts float32
or float64 arrays, DataFrames and lists (no input signature: MLflow's tensor check requires one exact dtype).
Logging goes through the tracker (Tracker.log_model): a LoggedModel named after the study under the pick run, with its
params, metrics and description; registration creates a version of it.
"""
from __future__ import annotations

import json
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from latentsweep.search.pick.candidates import share_data
from latentsweep.search.pick.plan import MODEL_EXPORT_S
from latentsweep.search.tracking.base import LoggedModel, ModelSpec, Tracker
from latentsweep.trainers.core.deadline import Deadline
from latentsweep.trainers.train.checkpoint import load_model

# The same names as in search/pick/pyfunc_standalone.py (not imported: running it registers its model with MLflow).
ARTIFACT_KEY = "ensemble"
SPEC_FILE = "ensemble.json"
MODEL_CODE = Path(__file__).with_name("pyfunc_standalone.py")
MODEL_TYPE = "latentsweep-ensemble"
EXPORT_ROWS = 2  # example batch for torch.export; the batch dimension is exported as dynamic
REGISTRY_DESCRIPTION = "latentsweep pick ensembles"


def model_name(study: str) -> str:
    """`<study>-ensemble` with the characters MLflow forbids in logged-model names (/ : . % " ') replaced."""
    return re.sub(r"[/:.%\"'\s]+", "_", f"{study}-ensemble")


class _Pred(torch.nn.Module):
    """A trained Translator as a plain tensor function: eval-mode "pred" output as float32
    (latentsweep.trainers.train.tasks.predict)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x)["pred"].float()


def export_member(checkpoint: Path, path: Path, data=None) -> None:
    """Save the checkpoint's model as a torch.export program taking float32 [N, Dt] for any N. `data`: the loaded
    TrainSet, which a knn member then reads its keys from (the same values; the checkpoint's copy of them is not read:
    0.67 GB of its pages at challenge size)."""
    model, _, meta = load_model(checkpoint, "cpu")
    model.eval()
    if data is not None:
        share_data(model, data, meta.get("data_fingerprint"))
    example = torch.zeros(EXPORT_ROWS, int(model.text_mean.numel()))
    program = torch.export.export(_Pred(model), (example,), dynamic_shapes={"x": {0: torch.export.Dim.DYNAMIC}})
    torch.export.save(program, str(path))


def stage_members(directory: Path, members: list[tuple[str, Path]], weights,
                  deadline: Deadline = Deadline.never(), data=None) -> Path | None:
    """Export the members with weight > 0 into directory/ with ensemble.json; returns directory, or None when the
    deadline leaves no room: the first export starts only when the model's measured cost fits
    (latentsweep.search.pick.plan.MODEL_EXPORT_S), each next one only when the slowest so far, times those left,
    still fits. A job then ends at most one member's export past its deadline."""
    directory.mkdir(parents=True, exist_ok=True)
    kept = [(index, name, checkpoint, float(weight))
            for index, ((name, checkpoint), weight) in enumerate(zip(members, weights)) if weight > 0]
    if not deadline.fits(MODEL_EXPORT_S):
        return None
    entries, slowest = [], 0.0
    for done, (index, name, checkpoint, weight) in enumerate(kept):
        if done and not deadline.fits(slowest * (len(kept) - done)):
            return None
        start = time.monotonic()
        file = f"member-{index:02d}.pt2"
        export_member(checkpoint, directory / file, data)
        slowest = max(slowest, time.monotonic() - start)
        entries.append({"name": name, "file": file, "weight": weight})
    (directory / SPEC_FILE).write_text(json.dumps({"members": entries}, indent=2))
    return directory


def requirements() -> tuple[str, ...]:
    """Pinned explicitly (inferring them would load the model in a subprocess): what the model code imports besides
    mlflow, which the tracker pins."""
    return f"torch=={torch.__version__.split('+')[0]}", f"numpy=={np.__version__}"


@dataclass(frozen=True)
class ModelCard:
    """What is shown with the logged ensemble: its name, tags, params, metrics and description."""
    name: str
    tags: dict[str, str]
    params: dict[str, Any]
    metrics: dict[str, float]
    description: str


def log_ensemble(tracker: Tracker, run_id: str, members: list[tuple[str, Path, float]], dims: tuple[int, int],
                 card: ModelCard, register: str | None = None,
                 deadline: Deadline = Deadline.never(), data=None) -> LoggedModel | None:
    """Log the ensemble of (name, checkpoint, weight) members as a pyfunc model output of run `run_id` (see
    Tracker.log_model); register it under `register` if given. None when the members' export does not fit before
    `deadline` (stage_members): nothing is created in the store then, not even a FAILED model."""
    with tempfile.TemporaryDirectory(prefix="latentsweep-export-") as tmp:
        staged = stage_members(Path(tmp) / "members", [(name, path) for name, path, _ in members],
                               np.array([w for *_, w in members]), deadline, data)
        if staged is None:
            return None
        spec = ModelSpec(name=card.name, code=MODEL_CODE, stage=lambda directory: {ARTIFACT_KEY: str(staged)},
                         output_dim=dims[1], model_type=MODEL_TYPE, requirements=requirements(),
                         metadata={"input": f"caption embeddings [N, {dims[0]}], float32 or float64 "
                                            "(array, DataFrame or lists)",
                                   "output": f"L2-normalised image-space embeddings float32 [N, {dims[1]}]"},
                         tags=dict(card.tags), params=dict(card.params), metrics=dict(card.metrics),
                         description=card.description, registry_description=REGISTRY_DESCRIPTION)
        return tracker.log_model(run_id, spec, register)


__all__ = ["ModelCard", "log_ensemble", "model_name", "stage_members"]
