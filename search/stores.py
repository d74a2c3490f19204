"""Where generated state lives: one state directory (default mlruns/) holding Optuna and MLflow SQLite files and
artifacts, and the one resolver of the Optuna storage URL, MLflow tracking URI and artifact root from it."""
from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from latentsweep.search.tracking.paths import ARTIFACTS, default_artifact_root, relocate_mlflow
from latentsweep.trainers.core.errors import LatentsweepError

ENV_VAR = "LATENTSWEEP_STATE_DIR"
DEFAULT_DIR = "mlruns"
# Study names become directory names (STATE/studies/<name>, STATE/picks/<name>) and MLflow experiment names: one
# path component of portable characters, never '.', '..' or a separator; 100 characters leaves room for the
# 255-byte file-name limit of common file systems once suffixes like "-20260101-120000" are added.
_SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,99}")


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
    if path.is_dir():
        relocate_mlflow(path)  # a copied or moved directory: its MLflow artifact URIs follow it
    return path


def safe_name(name: str, what: str = "study name") -> str:
    """`name` when it is safe as one path component everywhere a path is built from it; one-line error otherwise."""
    if not isinstance(name, str) or not _SAFE_NAME.fullmatch(name):
        raise LatentsweepError(f"{what} {name!r} is not allowed: use 1-100 letters, digits, '_', '-' or '.', "
                               f"starting with a letter, digit or '_'")
    return name


def read_only_storage(root: Path) -> str:
    """The default Optuna storage URL for commands that only read (status, pick): creates nothing, and opens the
    SQLite file read-only, immutable when its directory cannot be written (SQLite then cannot create the WAL
    index, and nobody can be writing there anyway)."""
    path = root / "optuna.db"
    if not path.is_file():
        raise LatentsweepError(f"no Optuna storage in {root} (optuna.db not found): run `latentsweep study run` "
                               "first, or pass --state-dir / --storage")
    if writable_dir(root):
        return default_storage(root)
    return f"sqlite:///file:{path}?mode=ro&immutable=1&uri=true"


def writable_dir(path: Path) -> bool:
    try:
        with tempfile.TemporaryFile(dir=path):
            return True
    except OSError:
        return False


def local_artifact_path(root: str) -> Path | None:
    """The directory of a local artifact root (a path or a file: URI); None for a remote one (s3:, http:, ...)."""
    if "://" in root and not root.startswith("file:"):
        return None
    return Path(root[len("file://"):] if root.startswith("file://") else root[len("file:"):]
                if root.startswith("file:") else root).expanduser()


def check_artifact_root(root: str) -> None:
    """A local artifact root (path or file: URI) must be creatable; remote ones (s3:, mlflow-artifacts:, …) are
    checked by MLflow when it writes."""
    path = local_artifact_path(root)
    if path is None:
        return
    ancestor = path
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir() or not writable_dir(ancestor):
        raise LatentsweepError(f"--artifact-root {root}: cannot create it ({ancestor} is not a writable directory)")


# What a state directory holds that no output may replace: the stores (with SQLite's journal files beside them), the
# trials' folders (config, metrics and best.pt of every trial: STATE/studies, latentsweep.search.study.worker.study_dir)
# and the
# artifacts. Not STATE/picks and STATE/train: the default outputs of `pick` and `train` go there.
STATE_FILES = {"optuna.db": "the Optuna storage", "mlflow.db": "the MLflow tracking store"}
STATE_DIRS = {"studies": "the trials' folders (checkpoints)", ARTIFACTS: "the MLflow artifacts"}
SQLITE_SIDECARS = ("-wal", "-shm", "-journal")


def sqlite_path(url: str | None) -> Path | None:
    """The file of a local SQLite URL (sqlite:///path, with URI options stripped); None for anything else."""
    if not url or not url.startswith("sqlite:///"):
        return None
    path = url[len("sqlite:///"):].split("?", 1)[0]
    return Path(path.removeprefix("file:")) if path else None


def protected_paths(root: Path | None, storage: str | None = None, tracking_uri: str | None = None,
                    artifact_root: str | None = None) -> dict[Path, str]:
    """Every file or folder a command's outputs must never replace or write into, each with what it is: the state
    directory `root`'s stores, trials' folders and artifacts, and the stores the command was given (local SQLite
    files, a local artifact root) wherever they are."""
    dbs: dict[Path, str] = {}
    if root is not None:
        dbs.update({root / name: what for name, what in STATE_FILES.items()})
    for url, what in ((storage, "the Optuna storage"), (tracking_uri, "the MLflow tracking store")):
        db = sqlite_path(url)
        if db is not None:
            dbs[db] = what
    found = {db.with_name(db.name + tail): what for db, what in dbs.items() for tail in ("", *SQLITE_SIDECARS)}
    if root is not None:
        found.update({root / name: what for name, what in STATE_DIRS.items()})
    local = local_artifact_path(artifact_root) if artifact_root else None
    if local is not None:
        found[local] = "the MLflow artifacts"
    return found


def default_protected() -> dict[Path, str]:
    """protected_paths of the default state directory ($LATENTSWEEP_STATE_DIR or ./mlruns), for the commands that
    take no --state-dir (`predict`, `data holdout`, `study init`): nothing is created."""
    return protected_paths(Path(os.environ.get(ENV_VAR) or DEFAULT_DIR).expanduser().resolve())


def default_storage(root: Path) -> str:
    """Optuna RDB storage URL of the embedded default (SQLite file in the state directory)."""
    return f"sqlite:///{root / 'optuna.db'}"


def default_tracking_uri(root: Path) -> str:
    """MLflow tracking URI of the embedded default (SQLite backend in the state directory)."""
    return f"sqlite:///{root / 'mlflow.db'}"


@dataclass(frozen=True)
class Stores:
    """The stores of a command: what was given explicitly, the state directory's defaults for the rest."""
    root: Path  # the state directory
    storage: str  # Optuna storage URL
    tracking_uri: str  # MLflow tracking URI
    artifact_root: str | None  # for new experiments; None: the tracker derives it from the tracking URI, or the
    # tracking server decides

    @property
    def server_artifact_root(self) -> str:
        """Where a local MLflow server started on these stores keeps artifacts: the tracker's root, else
        STATE/artifacts (a database tracking URI has no directory of its own)."""
        return self.artifact_root or default_artifact_root(self.tracking_uri) or (self.root / ARTIFACTS).as_uri()


def resolve_stores(root: Path, storage: str | None = None, tracking_uri: str | None = None,
                   artifact_root: str | None = None, read_only: bool = False) -> Stores:
    """Explicit values win; otherwise STATE/optuna.db (a read-only URL with `read_only`, for commands that only
    read), STATE/mlflow.db and, with the default tracking URI only, STATE/artifacts."""
    tracking = tracking_uri or default_tracking_uri(root)
    if artifact_root is None and tracking_uri is None:
        artifact_root = default_artifact_root(tracking)
    return Stores(root, storage or (read_only_storage(root) if read_only else default_storage(root)), tracking,
                  artifact_root)
