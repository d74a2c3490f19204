"""Experiment tracking: the Tracker interface (base), its MLflow and in-memory implementations, and the factory."""
from __future__ import annotations

from latentsweep.search.tracking.base import Tracker
from latentsweep.search.tracking.memory import InMemoryTracker

MEMORY_URIS = ("memory", "memory:", "memory://")


def make_tracker(uri: str, artifact_root: str | None = None) -> Tracker:
    """Tracker for a URI: 'memory' gives an InMemoryTracker, anything else an MlflowTracker."""
    if uri in MEMORY_URIS:
        return InMemoryTracker()
    # Imported here: importing mlflow takes seconds, and only commands that track in MLflow should pay for it.
    from latentsweep.search.tracking.mlflow import MlflowTracker

    return MlflowTracker(uri, artifact_root)
