"""The picked ensemble as a self-contained MLflow pyfunc model: caption embeddings [N, Dt] -> image-space [N, Di].

The members are exported with torch.export (member-NN.pt2, the model in eval mode returning its "pred" output) next
to ensemble.json (names, weights); the model code is search/pick/pyfunc_standalone.py, saved into the model, which needs
numpy, torch and mlflow only: the model loads and predicts where latentsweep is not installed. It accepts float32 or
float64 arrays, DataFrames and lists (no input signature: MLflow's tensor check requires one exact dtype).
Logging goes through MlflowClient only (no fluent active run): a LoggedModel named after the study is created under
the pick run with its params, metrics and description, the model directory is saved locally with
`mlflow.pyfunc.save_model` and uploaded with `log_model_artifacts`; registration creates a version of it.
"""
from __future__ import annotations

import json
import re
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import mlflow.pyfunc
import numpy as np
import torch

# The same names as in search/pick/pyfunc_standalone.py (not imported: running it registers its model with MLflow).
ARTIFACT_KEY = "ensemble"
SPEC_FILE = "ensemble.json"
MODEL_CODE = Path(__file__).with_name("pyfunc_standalone.py")
MODEL_TYPE = "latentsweep-ensemble"
EXPORT_ROWS = 2  # example batch for torch.export; the batch dimension is exported as dynamic


def model_name(study: str) -> str:
    """`<study>-ensemble` with the characters MLflow forbids in logged-model names (/ : . % " ') replaced."""
    return re.sub(r"[/:.%\"'\s]+", "_", f"{study}-ensemble")


@dataclass(frozen=True)
class LoggedEnsemble:
    model_id: str
    model_uri: str  # models:/<model_id>
    registered_name: str | None = None
    registered_version: str | None = None


class _Pred(torch.nn.Module):
    """A trained Translator as a plain tensor function: eval-mode "pred" output as float32 (trainers.tasks.predict)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x)["pred"].float()


def export_member(checkpoint: Path, path: Path) -> None:
    """Save the checkpoint's model as a torch.export program taking float32 [N, Dt] for any N."""
    from trainers.checkpoint import load_model

    model = load_model(checkpoint, "cpu")[0].eval()
    example = torch.zeros(EXPORT_ROWS, int(model.text_mean.numel()))
    program = torch.export.export(_Pred(model), (example,), dynamic_shapes={"x": {0: torch.export.Dim.DYNAMIC}})
    torch.export.save(program, str(path))


def stage_members(directory: Path, members: list[tuple[str, Path]], weights) -> Path:
    """Export the members with weight > 0 into directory/ with ensemble.json; returns directory."""
    directory.mkdir(parents=True, exist_ok=True)
    entries = []
    for index, ((name, checkpoint), weight) in enumerate(zip(members, weights)):
        if weight <= 0:
            continue
        file = f"member-{index:02d}.pt2"
        export_member(checkpoint, directory / file)
        entries.append({"name": name, "file": file, "weight": float(weight)})
    (directory / SPEC_FILE).write_text(json.dumps({"members": entries}, indent=2))
    return directory


def signature(dim_image: int):
    """Output float32 [-1, Di]; no input schema, so float32, float64 and lists are all accepted (see module doc)."""
    from mlflow.models import ModelSignature
    from mlflow.types import Schema, TensorSpec

    return ModelSignature(outputs=Schema([TensorSpec(np.dtype(np.float32), (-1, dim_image))]))


def _requirements() -> list[str]:
    """Pinned explicitly (inferring them would load the model in a subprocess): all the model code imports."""
    import mlflow

    return [f"mlflow=={mlflow.__version__}", f"torch=={torch.__version__.split('+')[0]}",
            f"numpy=={np.__version__}"]


def log_ensemble(client, experiment_id: str, run_id: str, members: list[tuple[str, Path]], weights,
                 dims: tuple[int, int], register: str | None = None, tags: dict[str, str] | None = None,
                 name: str = "ensemble", params: dict[str, str] | None = None,
                 metrics: dict[str, float] | None = None, description: str | None = None) -> LoggedEnsemble:
    """Log the ensemble as a pyfunc LoggedModel `name` output of run `run_id`, with params, metrics (linked to the
    run) and a description; register it under `register` if given."""
    from mlflow.entities import LoggedModelOutput
    from mlflow.models import Model

    tags = dict(tags or {})
    if description:
        tags["mlflow.note.content"] = description
    model = client.create_logged_model(experiment_id, name=name, source_run_id=run_id, model_type=MODEL_TYPE,
                                       tags=tags, params={k: str(v) for k, v in (params or {}).items()})
    try:
        with tempfile.TemporaryDirectory(prefix="latentsweep-pyfunc-") as tmp:
            staged = stage_members(Path(tmp) / "members", members, weights)
            local = Path(tmp) / "model"
            meta = Model(artifact_path=model.artifact_location, run_id=run_id, model_uuid=model.model_id,
                         model_id=model.model_id)
            with warnings.catch_warnings():
                # MLflow suggests type hints and an input example; the docstrings and the metadata say it.
                warnings.simplefilter("ignore", UserWarning)
                mlflow.pyfunc.save_model(str(local), python_model=str(MODEL_CODE),
                                         artifacts={ARTIFACT_KEY: str(staged)}, signature=signature(dims[1]),
                                         pip_requirements=_requirements(), mlflow_model=meta,
                                         metadata={"input": f"caption embeddings [N, {dims[0]}], float32 or float64 "
                                                            "(array, DataFrame or lists)",
                                                   "output": f"L2-normalised image-space embeddings float32 "
                                                             f"[N, {dims[1]}]"})
                client.log_model_artifacts(model.model_id, str(local))
    except BaseException:
        client.finalize_logged_model(model.model_id, "FAILED")
        raise
    client.finalize_logged_model(model.model_id, "READY")
    for key, value in (metrics or {}).items():  # shown on the model's page and in its metrics column
        client.log_metric(run_id, key, float(value), step=0, model_id=model.model_id)
    client.log_outputs(run_id, [LoggedModelOutput(model.model_id, step=0)])
    uri = f"models:/{model.model_id}"
    if register is None:
        return LoggedEnsemble(model.model_id, uri)
    version = register_ensemble(client, register, model.model_id, model.artifact_location, run_id)
    return LoggedEnsemble(model.model_id, uri, register, version)


def register_ensemble(client, name: str, model_id: str, source: str, run_id: str) -> str:
    """Create (if needed) the registered model `name` and a new version of the LoggedModel `model_id`; returns it.

    source is the LoggedModel's artifact location, not models:/<model_id>: MLflow 3.17's SQL registry store resolves a
    models:/ source through the process-wide tracking URI (its own TODO), which may not be this client's.
    """
    from mlflow.exceptions import MlflowException

    try:
        client.create_registered_model(name, description="latentsweep pick ensembles")
    except MlflowException as exc:
        if exc.error_code not in ("RESOURCE_ALREADY_EXISTS", "ALREADY_EXISTS"):
            raise
    version = client.create_model_version(name, source=source, run_id=run_id, model_id=model_id)
    return str(version.version)


__all__ = ["LoggedEnsemble", "model_name", "stage_members", "signature", "log_ensemble", "register_ensemble"]
