"""The pick ensemble's MLflow model code: loads and predicts with numpy, torch and mlflow only (no latentsweep).

MLflow saves this file into the model (models-from-code) and runs it at load time, so it must stay self-contained:
the members are torch.export programs (member-NN.pt2: caption embeddings [N, Dt] -> image-space outputs [N, Di]),
their weights are in ensemble.json. The combination repeats latentsweep.search.pick.ensemble.combine (tests check they
agree).
"""
import json
from pathlib import Path

import mlflow.pyfunc
import numpy as np
import torch
from mlflow.models import set_model

ARTIFACT_KEY = "ensemble"
SPEC_FILE = "ensemble.json"
CHUNK = 4096  # rows per forward pass, as latentsweep.trainers.train.tasks.EVAL_CHUNK: bounds memory on large inputs
EPS = 1e-12  # as latentsweep.search.pick.ensemble: a zero row stays zero instead of dividing by zero


def l2n(x):
    """Row-wise L2 normalisation of [N, D] as float32."""
    x = np.asarray(x, np.float32)
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), EPS)


def as_matrix(model_input):
    """float32 [N, Dt] from a float32/float64 array, a DataFrame (one row per caption), nested lists or one vector."""
    values = getattr(model_input, "values", model_input)  # DataFrame -> ndarray
    x = np.asarray(values.tolist() if values.dtype == object else values, np.float32) \
        if isinstance(values, np.ndarray) else np.asarray(values, np.float32)
    return x.reshape(1, -1) if x.ndim == 1 else x


class EnsembleModel(mlflow.pyfunc.PythonModel):
    """Weighted mean of the members' L2-normalised outputs, L2-normalised again: float32 [N, Di]."""

    def load_context(self, context) -> None:
        root = Path(context.artifacts[ARTIFACT_KEY])
        spec = json.loads((root / SPEC_FILE).read_text())
        self.members = [torch.export.load(str(root / m["file"])).module() for m in spec["members"]]
        self.weights = np.asarray([m["weight"] for m in spec["members"]], np.float64)

    def predict(self, context, model_input: np.ndarray, params=None) -> np.ndarray:
        """model_input: caption embeddings [N, Dt] (float32 or float64 array, DataFrame or lists). The ndarray hint is
        one MLflow infers no schema from, so it converts nothing (the output signature is logged explicitly) and
        does not warn that type hints are missing."""
        x = torch.from_numpy(np.ascontiguousarray(as_matrix(model_input)))
        total = None
        with torch.no_grad():
            for member, weight in zip(self.members, self.weights):
                out = torch.cat([member(x[i:i + CHUNK]) for i in range(0, len(x), CHUNK)]).numpy()
                part = np.float32(weight) * l2n(out)
                total = part if total is None else total + part
        return l2n(total)


set_model(EnsembleModel())
