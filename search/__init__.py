"""Studies: search spaces, Optuna storage and workers, MLflow tracking, the picker, the CLI and the Python API."""
# The Python API (search.api) is re-exported lazily: `import search` (every CLI start and spawned worker) stays free
# of its imports; `from search import run_study` or `search.pick(...)` loads it on first use.
from search import progress  # noqa: F401 - importing it points the progress channel at stderr
from trainers.progress import set_progress_sink  # the progress channel's switch (a callable, or None: silent)

API = ("load_ensemble", "pick_ensemble", "predict", "presets", "run", "run_study", "trials", "write_submission")
__all__ = [*API, "set_progress_sink"]


def __getattr__(name: str):
    if name in API:
        from search import api

        return getattr(api, name)
    raise AttributeError(f"module 'search' has no attribute {name!r}")
