"""Workers that die: SIGKILL mid-trial (SQLite and PostgreSQL), the heartbeat reaper, retries, and resuming a study.

Short heartbeats (1 s, grace 3 s) make a killed worker's trial stale within seconds. PostgreSQL tests use the
helpers of test_postgres (a fresh database per test, skipped only when the server is unreachable).
"""
from __future__ import annotations

import signal
import time
from pathlib import Path

import optuna
import pytest

from latentsweep.search.cli.main import main
from latentsweep.search.process import quiet_optuna
from latentsweep.search.study.storage import StorageSettings, dispose, open_storage
from latentsweep.search.study.worker import reap
from latentsweep.search.tracking.memory import InMemoryTracker
from test_postgres import (  # noqa: F401 - fixtures are used by name
    assert_clean, cli_args, parent_run, pg_db, pg_url, spawn_worker, study_file, synthetic, trial_runs, tracking,
)

GRACE_S = 3
HEARTBEAT = ("--heartbeat", "1", "--grace", str(GRACE_S))
START_TIMEOUT_S = 180  # a worker process imports torch, MLflow and Optuna first: tens of seconds on a loaded box


def storage_url(backend: str, request, tmp_path: Path) -> str:
    if backend == "postgres":
        return pg_url(request.getfixturevalue("pg_db"))
    return f"sqlite:///{tmp_path / 'optuna.db'}"


def trials(storage: str, name: str) -> list[optuna.trial.FrozenTrial]:
    return optuna.load_study(study_name=name, storage=storage).get_trials()


def runs_by_number(tracking_uri: str, name: str) -> dict[int, object]:
    runs = trial_runs(tracking_uri, name)
    numbers = [int(r.data.tags["optuna.trial_number"]) for r in runs]
    assert len(numbers) == len(set(numbers)), "a trial number has two MLflow runs"
    return dict(zip(numbers, runs))


def wait_for(predicate, what: str, procs=(), timeout: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            raise AssertionError(f"a worker exited (rc {dead[0].returncode}) before {what}: {dead[0].communicate()}")
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def sigkill(procs) -> None:
    for p in procs:
        p.send_signal(signal.SIGKILL)
    for p in procs:
        p.communicate()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_killed_worker_trial_is_failed_retried_and_its_run_reaped(backend, request, tmp_path, tracking, synthetic,
                                                                  capsys):
    storage, name, state = storage_url(backend, request, tmp_path), f"kill_{backend}", tmp_path / "state"
    sf = study_file(tmp_path, name, n_trials=2, epochs=400)  # trial 0 runs until it is killed
    args = cli_args(sf, storage, tracking, synthetic, state, *HEARTBEAT)
    assert main(["study", "create", *args]) == 0
    proc = spawn_worker(args)
    epoch_log = state / "studies" / name / "trial-0" / "metrics.csv"
    wait_for(epoch_log.exists, "trial 0's first epoch", [proc])
    sigkill([proc])
    assert [t.state.name for t in trials(storage, name)] == ["RUNNING"]
    assert [r.info.status for r in trial_runs(tracking, name)] == ["RUNNING"]
    time.sleep(GRACE_S + 2)  # longer than the grace period without a heartbeat: the trial is dead

    if backend == "sqlite":  # no worker alive: `study reap` fails the trial (queuing its retry) and closes the run
        assert main(["study", "reap", name, "--storage", storage, "--tracking-uri", tracking, "--state-dir",
                     str(state), *HEARTBEAT]) == 0
        assert "closed 1 stale MLflow run(s)" in capsys.readouterr().out
        dead, retry = trials(storage, name)
        assert (dead.state.name, retry.state.name) == ("FAIL", "WAITING")
        assert retry.system_attrs["failed_trial"] == 0 and retry.params == dead.params
        assert runs_by_number(tracking, name)[0].info.status == "FAILED"

    sf.write_text(sf.read_text().replace("epochs = 400", "epochs = 2"))
    assert main(["worker", *args]) == 0  # PostgreSQL: this worker's start is what reaps the dead trial
    assert_clean(capsys.readouterr().err)
    final = trials(storage, name)
    assert [t.state.name for t in final] == ["FAIL", "COMPLETE", "COMPLETE"]
    assert final[1].system_attrs["failed_trial"] == 0 and final[1].params == final[0].params
    runs = runs_by_number(tracking, name)
    assert runs[0].info.status == "FAILED" and runs[0].data.tags["latentsweep.reaped"] == "true"
    assert runs[0].data.tags["optuna.state"] == "FAIL"
    assert runs[1].data.tags["latentsweep.retry_of"] == "0"
    assert [runs[n].info.status for n in (1, 2)] == ["FINISHED", "FINISHED"]
    assert "latentsweep.retry_of" not in runs[2].data.tags
    assert parent_run(tracking, name).info.status == "FINISHED"  # nothing is left RUNNING in MLflow


@pytest.mark.slow
def test_kill_every_worker_then_resume_keeps_the_budget_exact(tmp_path, pg_db, tracking, synthetic, capsys):
    storage, name, n_trials = pg_url(pg_db), "resume_pg", 4
    sf = study_file(tmp_path, name, n_trials=n_trials, epochs=3)
    # A grace period longer than a worker's restart, so the dead trials still look alive when it claims.
    args = cli_args(sf, storage, tracking, synthetic, tmp_path / "state", "--heartbeat", "1", "--grace", "10")
    assert main(["study", "create", *args]) == 0
    procs = [spawn_worker(args) for _ in range(2)]

    def budget_full_with_running() -> bool:
        states = [t.state.name for t in trials(storage, name)]
        return states.count("COMPLETE") >= 2 and states.count("COMPLETE") + states.count("RUNNING") == n_trials

    wait_for(budget_full_with_running, "two finished trials and the rest of the budget running", procs)
    sigkill(procs)
    before = trials(storage, name)
    finished = {t.number: (t.value, t.params) for t in before if t.state.name == "COMPLETE"}
    dead = sorted(t.number for t in before if t.state.name == "RUNNING")
    assert dead and len(finished) + len(dead) == n_trials

    # Start again at once: the dead trials fill the budget until their grace is over, so the worker must wait for
    # them to go stale and run their retries instead of exiting with the budget short.
    assert main(["worker", *args]) == 0
    assert_clean(capsys.readouterr().err)
    after = trials(storage, name)
    complete = [t for t in after if t.state.name == "COMPLETE"]
    assert len(complete) == n_trials
    assert sorted(t.number for t in after if t.state.name == "FAIL") == dead
    assert not [t for t in after if t.state.name not in ("COMPLETE", "FAIL")]
    for number, (value, params) in finished.items():  # nothing finished was lost or run again
        assert (after[number].state.name, after[number].value, after[number].params) == ("COMPLETE", value, params)
    retried = sorted(t.system_attrs["failed_trial"] for t in complete if "failed_trial" in t.system_attrs)
    assert retried == dead
    runs = runs_by_number(tracking, name)
    assert all(r.info.status != "RUNNING" for r in runs.values())
    for t in complete:
        run = runs[t.number]
        assert run.info.status == "FINISHED" and "latentsweep.reaped" not in run.data.tags
        assert run.data.tags.get("latentsweep.retry_of") == (
            str(t.system_attrs["failed_trial"]) if "failed_trial" in t.system_attrs else None)
    for number in dead:  # killed before its MLflow run was created, or reaped (even if killed after ending it)
        if number in runs:
            assert runs[number].info.status == "FAILED" and runs[number].data.tags["latentsweep.reaped"] == "true"


def test_grace_period_must_outlast_a_heartbeat(tmp_path, synthetic, capsys):
    sf = study_file(tmp_path, "grace", n_trials=1)
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    args = cli_args(sf, storage, "memory", synthetic, tmp_path / "state", "--heartbeat", "5", "--grace", "5")
    assert main(["worker", *args]) == 2
    assert "--grace (5 s) must be longer than --heartbeat (5 s)" in capsys.readouterr().err
    assert not (tmp_path / "optuna.db").exists()  # refused before touching the storage


def test_worker_killed_after_ending_its_run_gets_the_run_failed(tmp_path):
    # The window between "MLflow run ended as FINISHED" and "Optuna told COMPLETE": the trial dies RUNNING, so the
    # reaper fails it in Optuna and must fail its run too, although that run is no longer RUNNING.
    quiet_optuna()  # ask/tell with heartbeats, as the workers do
    storage = open_storage(StorageSettings(f"sqlite:///{tmp_path / 'optuna.db'}", heartbeat_interval=1,
                                           grace_period=1))
    study = optuna.create_study(study_name="window", storage=storage)
    tracker = InMemoryTracker()
    tracker.ensure_study("window", {})
    trial = study.ask()
    storage.record_heartbeat(trial._trial_id)
    run_id = tracker.start_trial(trial.number, {}, {})
    trial.set_user_attr("mlflow_run_id", run_id)
    tracker.end_trial(run_id, "COMPLETE")  # ... and the worker is killed here, before study.tell
    time.sleep(2.5)  # SQLite heartbeats have 1 s resolution: well past the 1 s grace period
    assert reap(study, tracker) == [run_id]
    assert [t.state.name for t in study.get_trials()] == ["FAIL", "WAITING"]
    run = tracker.runs[run_id]
    assert run["status"] == "FAILED" and run["tags"]["latentsweep.reaped"] == "true"
    assert run["tags"]["optuna.state"] == "FAIL"
    assert reap(study, tracker) == []  # nothing left to close; the retry is queued once
    assert len(study.get_trials()) == 2
    dispose(storage)
