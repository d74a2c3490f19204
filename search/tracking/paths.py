"""Where artifacts live: the artifact root of a tracking URI, each experiment's location under it, and a movable
state directory (MLflow stores absolute file:// artifact URIs, so they are re-rooted when it moved).

MLflow's SQL store makes every artifact location absolute when an experiment is created (mlflow.utils.uri.
resolve_uri_if_local), and runs, logged models and model versions copy it. The experiments the tracker creates live
at <state>/artifacts/<experiment>; when the directory was copied or moved, every command (and `latentsweep ui`,
before it starts the servers) rewrites the old prefix to the directory's current one on open, so the MLflow UI, the
client, pyfunc loading and `pick` find the artifacts where the directory now is. Optuna attributes hold paths
relative to the state directory (latentsweep.search.study.objective.relative_to_state) and need nothing.
"""
from __future__ import annotations

import contextlib
import os
import re
import sqlite3
from pathlib import Path
from latentsweep.trainers.core.progress import say


ARTIFACTS = "artifacts"
# (table, column) pairs holding artifact URIs in MLflow 3.x (mlflow/store/tracking/dbmodels/models.py,
# mlflow/store/model_registry/dbmodels/models.py); a table or column absent from an older schema is skipped.
URI_COLUMNS = (("experiments", "artifact_location"), ("runs", "artifact_uri"),
               ("logged_models", "artifact_location"), ("model_versions", "source"),
               ("model_versions", "storage_location"))
SQLITE_TIMEOUT_S = 120  # as latentsweep.search.study.storage: wait behind a worker's write instead of failing


def _old_roots(conn: sqlite3.Connection, here: str) -> set[str]:
    """Prefixes P (a file URI or path) of experiment locations P/artifacts/<name> other than the current one."""
    roots = set()
    for (location,) in conn.execute("SELECT artifact_location FROM experiments WHERE artifact_location IS NOT NULL"):
        head, sep, name = str(location).rpartition(f"/{ARTIFACTS}/")
        if sep and name and "/" not in name.strip("/") and head not in (here, ""):
            roots.add(head)
    return roots


def _columns(conn: sqlite3.Connection) -> list[tuple[str, str]]:
    found = []
    for table, column in URI_COLUMNS:
        names = {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}
        if column in names:
            found.append((table, column))
    return found


def relocate_mlflow(state_dir: Path) -> int:
    """Re-root the artifact URIs in STATE/mlflow.db at STATE/artifacts; returns how many values changed."""
    db = Path(state_dir) / "mlflow.db"
    if not db.is_file():
        return 0
    if not (os.access(db, os.W_OK) and os.access(db.parent, os.W_OK)):  # read-only: the command says so itself
        return 0
    here = Path(state_dir).resolve().as_uri()
    try:
        with contextlib.closing(sqlite3.connect(db, timeout=SQLITE_TIMEOUT_S)) as conn:
            if not conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'experiments'").fetchone():
                return 0
            roots = _old_roots(conn, here)
            if not roots:
                return 0
            changed = 0
            with conn:  # one transaction: all columns or none
                for table, column in _columns(conn):
                    for old in roots:
                        prefix, new = f"{old}/{ARTIFACTS}/", f"{here}/{ARTIFACTS}/"
                        cur = conn.execute(
                            f"UPDATE {table} SET {column} = ? || substr({column}, ?) "
                            f"WHERE substr({column}, 1, ?) = ?", (new, len(prefix) + 1, len(prefix), prefix))
                        changed += cur.rowcount
            say(f"state directory moved: {changed} artifact URIs re-rooted at {here}")
            return changed
    except sqlite3.Error as exc:  # a locked or foreign file: report and carry on, artifacts may then be missing
        say(f"could not re-root MLflow artifact URIs in {db}: {exc}")
        return 0


def resolve_in_state(path: str | Path | None, state_dir: Path) -> Path | None:
    """A path recorded in the stores: relative ones are relative to the state directory."""
    if path in (None, ""):
        return None
    path = Path(path)
    return path if path.is_absolute() else Path(state_dir) / path


def default_artifact_root(tracking_uri: str) -> str | None:
    """Artifact root for a tracking URI: <db dir>/artifacts for a SQLite file, None (server decides) otherwise."""
    if tracking_uri.startswith("sqlite:///"):
        db = tracking_uri[len("sqlite:///"):].split("?")[0]
        return (Path(db).expanduser().resolve().parent / "artifacts").as_uri()
    return None


def artifact_location(root: str, experiment: str) -> str:
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", experiment).strip("._") or "study"
    if "://" in root or root.startswith("file:"):
        return f"{root.rstrip('/')}/{name}"
    return (Path(root).expanduser().resolve() / name).as_uri()
