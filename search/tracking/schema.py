"""A new SQLite MLflow store starts as a copy of an empty, migrated one, made once per machine and MLflow version.

MLflow builds a new database by running every alembic revision of its schema, one transaction each: 1-3 CPU-s and
8-13 s of wall time on a 2-core machine with a load average of 9 (measured 2026-11-27, `latentsweep run` in a fresh
state directory), which every fresh state directory paid before its first trial and which decided whether a
`run --time 60` searched at all. A copy takes milliseconds. The copy is made only where no file exists yet, by a
hard link of a finished copy (never over a store being created or used); the template has no experiment, so MLflow
creates its Default experiment itself on the first open, where the store's own settings put it. Anything that goes
wrong here leaves MLflow to build the store as before.
"""
from __future__ import annotations

import os
import shutil
import sqlite3
import tempfile
import uuid
from pathlib import Path

from latentsweep.search.stores import sqlite_path

# Off: MLflow migrates every new store itself (a check, and a way round a template this code cannot judge).
SCHEMA_ENV = "LATENTSWEEP_MLFLOW_TEMPLATE"


def seed_store(tracking_uri: str) -> bool:
    """Put an empty migrated MLflow store at `tracking_uri`'s SQLite file when none exists; whether it did."""
    target = sqlite_path(tracking_uri)
    if target is None or target.exists() or not target.parent.is_dir() or not enabled():
        return False
    try:
        template = _template()
        staged = target.with_name(f".{target.name}.{uuid.uuid4().hex}")
        shutil.copyfile(template, staged)
        try:
            os.link(staged, target)  # fails if another process made the store meanwhile: theirs stays
        finally:
            staged.unlink()
    except (OSError, sqlite3.Error):  # a full disk, a race lost, a file system without hard links: MLflow builds it
        return False
    return True


def enabled() -> bool:
    return os.environ.get(SCHEMA_ENV, "on").strip().lower() not in ("off", "0", "false", "no")


def _template() -> Path:
    """The empty store of this MLflow version in the temporary folder (built on first use, published by a rename)."""
    import mlflow

    folder = Path(tempfile.gettempdir()) / f"latentsweep-mlflow-{os.getuid()}"
    path = folder / f"empty-{mlflow.__version__}.db"
    if path.is_file():
        return path
    folder.mkdir(mode=0o700, exist_ok=True)
    staged = folder / f".build-{uuid.uuid4().hex}.db"
    try:
        _build(staged)
        os.replace(staged, path)  # two builders race harmlessly: each publishes a whole store
    finally:
        staged.unlink(missing_ok=True)
    return path


def _build(path: Path) -> None:
    """MLflow's own migrations into `path`, then its Default experiment removed (recreated at each store's first
    open with that store's artifact root)."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    store = SqlAlchemyStore(f"sqlite:///{path}", str(path.parent / "unused-artifacts"))
    store.engine.dispose()
    with sqlite3.connect(path) as db:
        db.execute("DELETE FROM experiment_tags WHERE experiment_id = 0")
        db.execute("DELETE FROM experiments WHERE experiment_id = 0")
    db.close()


__all__ = ["SCHEMA_ENV", "seed_store"]
