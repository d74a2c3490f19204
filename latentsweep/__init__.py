"""latentsweep: the one import name. `import latentsweep as ls` gives the Python API (latentsweep.search.api)."""
# The API is re-exported lazily: `import latentsweep` (every CLI start and spawned worker) stays free of its imports;
# `ls.run_study(...)` loads it on first use. The code lives in latentsweep.search (studies, tracking, the pick, the
# CLI) and latentsweep.trainers (the common trainer).
from pathlib import Path

_CHECKOUT = Path(__file__).resolve().parent.parent
if not (Path(__file__).parent / "search").is_dir() and (_CHECKOUT / "search" / "api.py").is_file():
    # A source checkout (the repository keeps search/ and trainers/ at its top; the wheel installs them here): the
    # checkout's folders are this package's subpackages, with or without an install.
    __path__.append(str(_CHECKOUT))  # noqa: F821 - a package's own __path__

from latentsweep.search import progress  # noqa: E402,F401 - importing it points the progress channel at stderr
from latentsweep.trainers.core.progress import set_progress_sink  # noqa: E402 - the channel's switch (None: silent)

API = ("load_ensemble", "pick_ensemble", "predict", "presets", "run", "run_study", "trials", "write_submission")
__all__ = [*API, "set_progress_sink"]


def __getattr__(name: str):
    if name in API:
        from latentsweep.search import api

        return getattr(api, name)
    raise AttributeError(f"module 'latentsweep' has no attribute {name!r}")
