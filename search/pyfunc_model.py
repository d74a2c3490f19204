"""The picked ensemble as an MLflow pyfunc model: caption embeddings float32 [N, Dt] -> image-space embeddings [N, Di].

The model's one artifact is a directory holding the member checkpoints (member-00.pt, ...) and ensemble.json (member
names and weights); `EnsembleModel` rebuilds the members with `trainers.checkpoint.load_model`, so loading needs the
latentsweep package importable. Logging goes through MlflowClient only (no fluent active run): a LoggedModel is
created under the pick run, the model directory is saved locally with `mlflow.pyfunc.save_model` and uploaded with
`log_model_artifacts`; registration creates a model version of that LoggedModel.
"""
from __future__ import annotations

import json
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import mlflow.pyfunc
import numpy as np

from search.ensemble import combine

ARTIFACT_KEY = "ensemble"
SPEC_FILE = "ensemble.json"
MODEL_NAME = "ensemble"
MODEL_TYPE = "latentsweep-ensemble"
# Models from code (MLflow's recommended form, no cloudpickle): this script is saved in the model and run at load time.
MODEL_CODE = """\"\"\"Entry of a latentsweep pick ensemble (MLflow models-from-code).\"\"\"
from mlflow.models import set_model

from search.pyfunc_model import EnsembleModel

set_model(EnsembleModel())
"""


class EnsembleModel(mlflow.pyfunc.PythonModel):
    """Weighted mean of the members' L2-normalised outputs, L2-normalised again (search.ensemble.combine)."""

    def load_context(self, context) -> None:
        from trainers.checkpoint import load_model
        from trainers.loop import resolve_device

        root = Path(context.artifacts[ARTIFACT_KEY])
        spec = json.loads((root / SPEC_FILE).read_text())
        self.device = resolve_device(spec.get("device", "auto"))
        self.members = [load_model(root / m["file"], self.device)[0] for m in spec["members"]]
        self.weights = np.asarray([m["weight"] for m in spec["members"]], np.float64)

    def predict(self, context, model_input: np.ndarray, params: dict | None = None) -> np.ndarray:
        """model_input: float32 [N, Dt] (a numpy array, or a DataFrame of N rows); returns float32 [N, Di]."""
        import torch

        from trainers.tasks import predict

        x = torch.as_tensor(np.ascontiguousarray(np.asarray(model_input, np.float32)), device=self.device)
        outputs = [predict(member, x).cpu().numpy() for member in self.members]
        return combine(outputs, self.weights)


@dataclass(frozen=True)
class LoggedEnsemble:
    model_id: str
    model_uri: str  # models:/<model_id>
    registered_name: str | None = None
    registered_version: str | None = None


def stage_members(directory: Path, members: list[tuple[str, Path]], weights, device: str = "auto") -> Path:
    """Copy the checkpoints of the members with weight > 0 into directory/ with ensemble.json; returns directory."""
    directory.mkdir(parents=True, exist_ok=True)
    entries = []
    for index, ((name, checkpoint), weight) in enumerate(zip(members, weights)):
        if weight <= 0:
            continue
        file = f"member-{index:02d}.pt"
        shutil.copyfile(checkpoint, directory / file)
        entries.append({"name": name, "file": file, "weight": float(weight)})
    (directory / SPEC_FILE).write_text(json.dumps({"members": entries, "device": device}, indent=2))
    return directory


def signature(dim_text: int, dim_image: int):
    """Unnamed float32 tensors: input [-1, Dt], output [-1, Di]."""
    from mlflow.models import ModelSignature
    from mlflow.types import Schema, TensorSpec

    return ModelSignature(inputs=Schema([TensorSpec(np.dtype(np.float32), (-1, dim_text))]),
                          outputs=Schema([TensorSpec(np.dtype(np.float32), (-1, dim_image))]))


def _requirements() -> list[str]:
    """Pinned explicitly: inferring them would load the model in a subprocess (slow) and miss latentsweep itself."""
    import mlflow
    import torch

    return [f"mlflow=={mlflow.__version__}", f"torch=={torch.__version__.split('+')[0]}",
            f"numpy=={np.__version__}"]


def log_ensemble(client, experiment_id: str, run_id: str, members: list[tuple[str, Path]], weights,
                 dims: tuple[int, int], register: str | None = None, tags: dict[str, str] | None = None
                 ) -> LoggedEnsemble:
    """Log the ensemble as a pyfunc LoggedModel output of run `run_id`; register it under `register` if given."""
    from mlflow.entities import LoggedModelOutput
    from mlflow.models import Model

    model = client.create_logged_model(experiment_id, name=MODEL_NAME, source_run_id=run_id, model_type=MODEL_TYPE,
                                       tags=tags)
    try:
        with tempfile.TemporaryDirectory(prefix="latentsweep-pyfunc-") as tmp:
            staged = stage_members(Path(tmp) / "members", members, weights)
            local = Path(tmp) / "model"
            code = Path(tmp) / "ensemble_model.py"
            code.write_text(MODEL_CODE)
            meta = Model(artifact_path=model.artifact_location, run_id=run_id, model_uuid=model.model_id,
                         model_id=model.model_id)
            with warnings.catch_warnings():
                # MLflow suggests type hints and an input example; the explicit tensor signature already says it all.
                warnings.simplefilter("ignore", UserWarning)
                mlflow.pyfunc.save_model(str(local), python_model=str(code), artifacts={ARTIFACT_KEY: str(staged)},
                                         signature=signature(*dims), pip_requirements=_requirements(),
                                         mlflow_model=meta,
                                         metadata={"requires": "the latentsweep package (trainers.checkpoint)"})
            client.log_model_artifacts(model.model_id, str(local))
    except BaseException:
        client.finalize_logged_model(model.model_id, "FAILED")
        raise
    client.finalize_logged_model(model.model_id, "READY")
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


__all__ = ["EnsembleModel", "LoggedEnsemble", "stage_members", "signature", "log_ensemble", "register_ensemble"]
