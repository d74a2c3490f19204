"""Studies on a real PostgreSQL server: four `latentsweep worker` processes on one study, and no password in any output.

Each test creates its own database (unique name) on 127.0.0.1:5432 (user postgres, trust auth) and drops it at the
end; the tests skip only when that server is unreachable. MLflow tracking is a SQLite file shared by the workers
(MLflow opens every SQLite session with PRAGMA busy_timeout = 20000, enough for four writers of tiny batches).
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import optuna
import pytest
from mlflow import MlflowClient

from conftest import tiny_study_file as study_file
from latentsweep.search.cli.main import main
from latentsweep.trainers.data.synthetic import write_synthetic

PG_HOST, PG_PORT, PG_USER, PG_ADMIN_DB = "127.0.0.1", 5432, "postgres", "test"
PASSWORD = "s3cret"  # trust auth ignores it; it must still never be shown
# Output that must never appear in a worker's stderr (SQLite lock errors, pool exhaustion, tracebacks, warnings).
BAD_OUTPUT = ("Traceback", "Error", "error:", "WARNING", "Warning", "locked", "QueuePool limit")



def _admin():
    """Autocommit connection to the admin database (CREATE/DROP DATABASE cannot run in a transaction)."""
    import psycopg2

    conn = psycopg2.connect(host=PG_HOST, port=PG_PORT, user=PG_USER, dbname=PG_ADMIN_DB, connect_timeout=5)
    conn.autocommit = True
    return conn


def pg_url(db: str, password: str | None = None) -> str:
    auth = f"{PG_USER}:{password}" if password else PG_USER
    return f"postgresql+psycopg2://{auth}@{PG_HOST}:{PG_PORT}/{db}"


def connections(db: str) -> int:
    """Client connections the server holds open to `db` right now."""
    with _admin() as conn, conn.cursor() as cur:
        cur.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()", (db,))
        count = cur.fetchone()[0]
    conn.close()
    return count


@pytest.fixture
def pg_db():
    """A fresh database for one test (dropped at the end); skips only when the server is unreachable."""
    import psycopg2

    try:
        conn = _admin()
    except psycopg2.OperationalError as exc:
        pytest.skip(f"PostgreSQL at {PG_HOST}:{PG_PORT} unreachable: {str(exc).strip().splitlines()[0]}")
    name = f"ls_test_{uuid.uuid4().hex[:12]}"
    with conn.cursor() as cur:
        cur.execute(f'CREATE DATABASE "{name}"')
    try:
        yield name
    finally:
        with conn.cursor() as cur:  # a killed worker's connections may linger until the server notices
            cur.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,))
            cur.execute(f'DROP DATABASE IF EXISTS "{name}"')
        conn.close()


@pytest.fixture(scope="module")
def tracking(tmp_path_factory) -> str:
    """One MLflow SQLite database per module (its schema migrations run once; each test uses its own study name)."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> Path:
    train, _, _ = write_synthetic(tmp_path_factory.mktemp("syn"), 200, dim_text=24, dim_image=32)
    return train


def cli_args(sf: Path, storage: str, tracking: str, data: Path, state: Path, *extra: str) -> list[str]:
    return [str(sf), "--storage", storage, "--tracking-uri", tracking, "--data", str(data),
            "--state-dir", str(state), "--quiet", *extra]


def spawn_worker(args: list[str]) -> subprocess.Popen:
    """`latentsweep worker ARGS` as a separate process (as on another machine), output captured."""
    return subprocess.Popen([sys.executable, "-m", "latentsweep", "worker", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def trial_runs(tracking: str, name: str) -> list:
    client = MlflowClient(tracking)
    exp = client.get_experiment_by_name(name)
    return client.search_runs([exp.experiment_id], "tags.`latentsweep.role` = 'trial'", max_results=1000)


def parent_run(tracking: str, name: str):
    client = MlflowClient(tracking)
    exp = client.get_experiment_by_name(name)
    (parent,) = client.search_runs([exp.experiment_id], "tags.`latentsweep.role` = 'parent'")
    return parent


def assert_clean(err: str) -> None:
    bad = [line for line in err.splitlines() if any(b in line for b in BAD_OUTPUT)]
    assert not bad, err


@pytest.mark.slow
def test_four_workers_share_one_postgres_study(tmp_path, pg_db, tracking, synthetic):
    sf = study_file(tmp_path, "pg4", n_trials=8)
    args = cli_args(sf, pg_url(pg_db), tracking, synthetic, tmp_path / "state", "--heartbeat", "2", "--grace", "30")
    assert main(["study", "create", *args]) == 0
    procs = [spawn_worker(args) for _ in range(4)]
    peak = 0
    while any(p.poll() is None for p in procs):  # connection hygiene: at most pool (2) + budget lock (1) each
        peak = max(peak, connections(pg_db))
        time.sleep(0.5)
    outs = [p.communicate() for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        assert_clean(err)
    assert 0 < peak <= 4 * 3
    assert connections(pg_db) == 0  # every engine disposed at exit
    ran = [json.loads(out.strip().splitlines()[-1])["trials_run_by_this_worker"] for out, _ in outs]
    assert sum(ran) == 8

    trials = optuna.load_study(study_name="pg4", storage=pg_url(pg_db)).get_trials()
    assert sorted(t.number for t in trials) == list(range(8))
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    runs = trial_runs(tracking, "pg4")
    by_number = {int(r.data.tags["optuna.trial_number"]): r for r in runs}
    assert len(runs) == 8 and sorted(by_number) == list(range(8))  # one run per trial, none duplicated
    for t in trials:
        run = by_number[t.number]
        assert run.info.run_id == t.user_attrs["mlflow_run_id"]
        assert run.info.status == "FINISHED" and run.data.tags["optuna.state"] == "COMPLETE"
        assert float(run.data.params["optim.lr"]) == pytest.approx(t.params["optim.lr"])
    # no `study run` around the workers: the one that finished the last trial closed the parent run with the summary
    parent = parent_run(tracking, "pg4")
    assert parent.info.status == "FINISHED" and parent.data.metrics["trials_complete"] == 8


def _all_text(client: MlflowClient, run) -> str:
    data = client.get_run(run.info.run_id).data
    return json.dumps([data.params, data.tags, run.info.run_name])


def test_password_in_storage_url_is_never_shown(tmp_path, pg_db, tracking, synthetic, capsys, caplog):
    sf = study_file(tmp_path, "secret", n_trials=1)
    args = cli_args(sf, pg_url(pg_db, PASSWORD), tracking, synthetic, tmp_path / "state")
    assert main(["study", "create", *args]) == 0
    assert main(["study", "run", *args]) == 0
    assert main(["worker", *args]) == 0  # budget spent: joins, reaps, runs nothing
    assert main(["study", "reap", "secret", "--storage", pg_url(pg_db, PASSWORD), "--tracking-uri", tracking,
                 "--state-dir", str(tmp_path / "state")]) == 0
    assert main(["worker", *args, "--name", "nosuch"]) == 2  # the error names the storage
    assert main(["study", "status", "secret", "--storage", pg_url(pg_db, PASSWORD)]) == 0
    wrong_port = pg_url(pg_db, PASSWORD).replace(f":{PG_PORT}/", ":1/")
    assert main(["study", "create", *cli_args(sf, wrong_port, tracking, synthetic, tmp_path / "state")]) == 2
    out, err = capsys.readouterr()
    assert "does not exist" in err and "cannot open Optuna storage" in err  # the error paths did run
    assert "postgres:***@" in out + err
    assert PASSWORD not in out + err + caplog.text

    client = MlflowClient(tracking)
    exp = client.get_experiment_by_name("secret")
    runs = client.search_runs([exp.experiment_id])
    assert {r.data.tags["latentsweep.role"] for r in runs} == {"parent", "trial"}
    for run in runs:
        assert PASSWORD not in _all_text(client, run)
    study = optuna.load_study(study_name="secret", storage=pg_url(pg_db))
    assert PASSWORD not in json.dumps([study.user_attrs, [t.user_attrs for t in study.get_trials()]], default=str)
