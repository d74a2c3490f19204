"""Where generated state lives: one state directory (default mlruns/) holding Optuna and MLflow SQLite files and artifacts."""
from __future__ import annotations

import os
from pathlib import Path

from trainers.errors import LatentsweepError

ENV_VAR = "LATENTSWEEP_STATE_DIR"
DEFAULT_DIR = "mlruns"


def add_state_arg(parser) -> None:
    parser.add_argument(
        "--state-dir",
        default=None,
        help=f"directory for generated state (default: ${ENV_VAR} or ./{DEFAULT_DIR})",
    )


def state_dir(arg: str | None = None, create: bool = True) -> Path:
    """Resolve the state directory: explicit argument, then $LATENTSWEEP_STATE_DIR, then ./mlruns."""
    path = Path(arg or os.environ.get(ENV_VAR) or DEFAULT_DIR).expanduser().resolve()
    if create:
        try:
            path.mkdir(parents=True, exist_ok=True)
            probe = path / ".write-probe"
            probe.touch()
            probe.unlink()
        except OSError as exc:
            raise LatentsweepError(f"state directory {path} is not writable: {exc.strerror}") from None
    return path


def default_storage(root: Path) -> str:
    """Optuna RDB storage URL of the embedded default (SQLite file in the state directory)."""
    return f"sqlite:///{root / 'optuna.db'}"


def default_tracking_uri(root: Path) -> str:
    """MLflow tracking URI of the embedded default (SQLite backend in the state directory)."""
    return f"sqlite:///{root / 'mlflow.db'}"


def default_artifact_root(root: Path) -> str:
    return (root / "artifacts").as_uri()
