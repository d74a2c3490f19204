"""A new SQLite MLflow store is a copy of a migrated empty one: the same schema and Default experiment as MLflow's
own build, never over an existing store, and MLflow's own build whenever the copy cannot be made."""
from __future__ import annotations

import sqlite3
import tempfile
from pathlib import Path

import pytest
from mlflow import MlflowClient

from latentsweep.search.tracking import make_tracker
from latentsweep.search.tracking.schema import SCHEMA_ENV, seed_store


def _schema(db: Path) -> tuple:
    with sqlite3.connect(db) as c:
        tables = sorted(r[0] for r in c.execute("SELECT name FROM sqlite_master WHERE type = 'table'"))
        version = c.execute("SELECT version_num FROM alembic_version").fetchall()
        experiments = c.execute("SELECT experiment_id, name, artifact_location, lifecycle_stage FROM experiments")
        return tables, version, experiments.fetchall()


def test_a_seeded_store_is_what_mlflow_builds(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # MLflow puts the Default experiment's artifacts under the working directory
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    seeded, built = tmp_path / "a" / "mlflow.db", tmp_path / "b" / "mlflow.db"
    assert seed_store(f"sqlite:///{seeded}") is True
    MlflowClient(f"sqlite:///{seeded}").search_experiments()  # MLflow's first open of the copy
    monkeypatch.setenv(SCHEMA_ENV, "off")
    make_tracker(f"sqlite:///{built}", str(tmp_path / "b" / "artifacts"))
    assert _schema(seeded) == _schema(built)
    monkeypatch.delenv(SCHEMA_ENV)
    tracker = make_tracker(f"sqlite:///{seeded}", str(tmp_path / "a" / "artifacts"))
    run = tracker.ensure_study("seeded", {"objective": "val/mrr"})
    assert MlflowClient(f"sqlite:///{seeded}").get_run(run).info.status == "RUNNING"


def test_an_existing_store_is_never_replaced(tmp_path):
    db = tmp_path / "mlflow.db"
    tracker = make_tracker(f"sqlite:///{db}", str(tmp_path / "artifacts"))
    run = tracker.ensure_study("kept", {"objective": "val/mrr"})
    assert seed_store(f"sqlite:///{db}") is False
    assert MlflowClient(f"sqlite:///{db}").get_run(run).info.run_name == "study-kept"
    empty = tmp_path / "empty.db"
    empty.touch()  # whatever is there, even an empty file another process just created, is theirs
    assert seed_store(f"sqlite:///{empty}") is False and empty.stat().st_size == 0


@pytest.mark.parametrize("uri", ["postgresql://u@127.0.0.1/x", "file:///tmp/mlruns", "sqlite:///nowhere/x/mlflow.db"])
def test_only_a_new_local_sqlite_file_is_seeded(uri):
    assert seed_store(uri) is False


def test_without_a_template_mlflow_builds_the_store_itself(tmp_path, monkeypatch):
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("")
    monkeypatch.setattr(tempfile, "tempdir", str(blocked))  # the template's folder cannot be made
    db = tmp_path / "mlflow.db"
    assert seed_store(f"sqlite:///{db}") is False and not db.exists()
    make_tracker(f"sqlite:///{db}", str(tmp_path / "artifacts")).ensure_study("built", {"objective": "val/mrr"})
    assert "experiments" in _schema(db)[0]
