"""One classification of failures (search/failures.py), injected at each place it can arise, with the real tracker on a
real SQLite MLflow store: faults come from MLflow's store below it (fault_kit) or from a loss module, never from a
patched method of the code under test."""
from __future__ import annotations

import errno
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
import torch
from mlflow import MlflowClient

import fault_kit
from conftest import tiny_study_file as study_file
from latentsweep.search.cli.main import main
from latentsweep.search.failures import Kind, classify
from latentsweep.search.tracking.mlflow import MlflowTracker
from latentsweep.trainers.core.errors import ConfigError
from latentsweep.trainers.train.loop import TrainingDiverged
from latentsweep.trainers.core.progress import progress_to
from latentsweep.trainers.data.synthetic import write_synthetic

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> Path:
    train, _, _ = write_synthetic(tmp_path_factory.mktemp("syn"), 120, dim_text=8, dim_image=12, n_test=20)
    return train


@pytest.fixture(scope="module")
def faulty_tracking(tmp_path_factory):
    """One MLflow SQLite store per module behind the faulty store (schema creation is slow); studies differ by name."""
    previous = fault_kit.install()
    root = tmp_path_factory.mktemp("faulty")
    yield f"sqlite:///{root / 'mlflow.db'}", str(root / "artifacts")
    fault_kit.uninstall(previous)


@pytest.fixture
def fault(monkeypatch):
    fault_kit._calls.clear()

    def set_fault(spec: str) -> None:
        monkeypatch.setenv(fault_kit.FAULT_ENV, spec)
    return set_fault


def raised(fn) -> BaseException:
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - returned for classification
        return exc
    raise AssertionError("nothing raised")


def test_real_errors_are_classified_once(faulty_tracking, fault):
    def full_disk():
        with open("/dev/full", "w") as fh:
            fh.write("x" * 65536)

    tracker = MlflowTracker(*faulty_tracking)
    tracker.ensure_study("classes", {})
    run_id = tracker.start_trial(0, {}, {})
    fault("epoch:outage")
    outage = raised(lambda: tracker.log(run_id, metrics={"val/mrr": 0.5}, step=0))
    fault("epoch:bug")
    bug = raised(lambda: tracker.log(run_id, metrics={"val/mrr": 0.5}, step=0))
    # what Optuna's storage raises once its server is gone (open_storage says it in one line at the start instead)
    dead_storage = raised(lambda: optuna.storages.RDBStorage("postgresql+psycopg2://u:pw@127.0.0.1:9/x"))
    cases = {Kind.MEMORY: [raised(lambda: torch.empty(1 << 50)), MemoryError(), torch.OutOfMemoryError("CUDA")],
             Kind.MACHINE: [raised(full_disk), raised(lambda: open("/nonexistent-dir/x"))],
             Kind.OUTAGE: [outage, dead_storage],
             Kind.CONFIG: [ConfigError("loss.queue.size must divide"), TrainingDiverged("loss is not finite")],
             Kind.INTERRUPT: [KeyboardInterrupt()],
             Kind.BUG: [bug, raised(lambda: [][1]), raised(lambda: None + 1)]}
    for kind, errors in cases.items():
        assert [classify(e).kind for e in errors] == [kind] * len(errors), [repr(e)[:200] for e in errors]
    assert "DefaultCPUAllocator: can't allocate memory" in classify(cases[Kind.MEMORY][0]).reason
    assert classify(cases[Kind.MACHINE][0]).exc.errno == errno.ENOSPC
    assert "pw" not in classify(dead_storage).reason and "\n" not in classify(outage).reason
    assert "Traceback" in classify(bug).detail and classify(bug).reason == "TypeError: injected bug in epoch"
    fault("")
    tracker.end_trial(run_id, "COMPLETE")


def test_a_real_http_outage_is_an_outage(monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    tracker = MlflowTracker("http://127.0.0.1:9")
    assert classify(raised(lambda: tracker.ensure_study("x", {}))).kind is Kind.OUTAGE


def study(state: Path, name: str) -> optuna.Study:
    return optuna.load_study(study_name=name, storage=f"sqlite:///{state / 'optuna.db'}")


def runs(tracking: str, name: str) -> dict[str, object]:
    client = MlflowClient(tracking)
    exp = client.get_experiment_by_name(name)
    return {r.info.run_name: r for r in client.search_runs([exp.experiment_id])}


def run_study(sf: Path, synthetic: Path, state: Path, tracking) -> int:
    return main(["study", "run", str(sf), "--data", str(synthetic), "--state-dir", str(state), "--quiet",
                 "--tracking-uri", tracking[0], "--artifact-root", tracking[1]])


@pytest.mark.parametrize("call", ["epoch", "start", "note"])
def test_a_bug_anywhere_in_a_trial_halts_loudly_and_is_not_retried(call, synthetic, tmp_path, faulty_tracking,
                                                                    fault):
    # note: the bug comes after train() returned; start: before training, while the run is opened
    fault(f"{call}:bug")
    name, state = f"bug_{call}", tmp_path / "state"
    with pytest.raises(TypeError, match=f"injected bug in {call}"):  # the traceback reaches the user
        run_study(study_file(tmp_path, name, n_trials=3, epochs=1), synthetic, state, faulty_tracking)
    trials = study(state, name)
    assert [t.state.name for t in trials.trials] == ["FAIL"]  # counted, never retried
    assert trials.trials[0].user_attrs["latentsweep.error"] == f"TypeError: injected bug in {call}"
    assert trials.user_attrs["latentsweep.halted"].startswith("trial 0 raised TypeError")
    statuses = {n: r.info.status for n, r in runs(faulty_tracking[0], name).items()}
    assert "RUNNING" not in statuses.values()
    if call != "start":  # the run was opened: it ends FAILED with the traceback
        run = runs(faulty_tracking[0], name)["trial-0"]
        assert run.info.status == "FAILED" and "Traceback" in run.data.tags["latentsweep.error"]


@pytest.mark.parametrize("call", ["epoch", "start", "note"])
def test_a_store_outage_stops_in_one_line_and_retries_the_trial(call, synthetic, tmp_path, faulty_tracking, fault,
                                                                 capsys):
    fault(f"{call}:outage")
    name, state = f"outage_{call}", tmp_path / "state"
    assert run_study(study_file(tmp_path, name, n_trials=3, epochs=1), synthetic, state, faulty_tracking) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("latentsweep: error: trial 0: ") and "Traceback" not in "\n".join(err)
    assert err[-1].endswith("the trial is retried when the study runs again") and "MlflowException" in err[-1]
    if call == "epoch":
        assert "cannot record epoch 0" in err[-1]
    trials = study(state, name)
    assert [t.state.name for t in trials.trials] == ["FAIL", "WAITING"]  # not counted, retried once
    assert "latentsweep.error" not in trials.trials[0].user_attrs and not trials.user_attrs.get("latentsweep.halted")
    assert "RUNNING" not in {r.info.status for r in runs(faulty_tracking[0], name).values()}
    fault("")  # the store is back: the retry runs and the budget is exact
    assert run_study(study_file(tmp_path, name, n_trials=3, epochs=1), synthetic, state, faulty_tracking) == 0
    states = [t.state.name for t in study(state, name).trials]
    assert states == ["FAIL", "COMPLETE", "COMPLETE", "COMPLETE"]


CPU_ALLOCATION = "DefaultCPUAllocator: can't allocate memory"


def fail_in_loss(monkeypatch, errors: list) -> None:
    """The loss raises the next of `errors` (an exception, or a callable that raises a real one), then trains."""
    from latentsweep.trainers.losses.core import InfoNCE

    real = InfoNCE.terms

    def terms(self, *args, **kwargs):
        if errors:
            error = errors.pop(0)
            if callable(error) and not isinstance(error, BaseException):
                error()
            raise error
        return real(self, *args, **kwargs)

    monkeypatch.setattr(InfoNCE, "terms", terms)


def test_config_and_memory_failures_count_and_the_study_goes_on(synthetic, tmp_path, faulty_tracking, fault,
                                                                 monkeypatch):
    # trial 0: a config error whose run cannot be closed (end_trial raises on both attempts after the error is known):
    # counted once, not retried, its run closed by the next claim; trial 1: a real CPU allocation failure; trial 2
    # completes.
    fault("end:outage:1-2")
    fail_in_loss(monkeypatch, [ConfigError("loss.queue.size must divide the batch size"),
                               lambda: torch.empty(1 << 50)])
    name, state = "configmem", tmp_path / "state"
    warned: list[str] = []
    with progress_to(warned.append):
        assert run_study(study_file(tmp_path, name, n_trials=3, epochs=1), synthetic, state, faulty_tracking) == 0
    trials = study(state, name).trials
    assert [t.state.name for t in trials] == ["FAIL", "FAIL", "COMPLETE"]  # no WAITING copy: nothing retried
    assert trials[0].user_attrs["latentsweep.error"] == "loss.queue.size must divide the batch size"
    assert CPU_ALLOCATION in trials[1].user_attrs["latentsweep.error"]
    assert not study(state, name).user_attrs.get("latentsweep.halted")
    assert any(m.startswith("could not close the MLflow run of trial 0 (") for m in warned)
    by_name = runs(faulty_tracking[0], name)
    assert by_name["trial-0"].info.status == "FAILED" and by_name["trial-0"].data.tags["latentsweep.reaped"] == "true"
    assert [by_name[f"trial-{n}"].info.status for n in (1, 2)] == ["FAILED", "FINISHED"]
    assert "RUNNING" not in {r.info.status for r in by_name.values()}


def test_a_run_whose_end_fails_once_is_ended_by_the_second_attempt(synthetic, tmp_path, faulty_tracking, fault):
    # An interrupt inside a store call can leave that connection unusable for the run's end: one more attempt.
    fault("end:outage:1")
    name, state = "endonce", tmp_path / "state"
    said: list[str] = []
    with progress_to(said.append):
        assert run_study(study_file(tmp_path, name, n_trials=1, epochs=1), synthetic, state, faulty_tracking) == 0
    assert [t.state.name for t in study(state, name).trials] == ["COMPLETE"]
    run = runs(faulty_tracking[0], name)["trial-0"]
    assert run.info.status == "FINISHED" and "latentsweep.reaped" not in run.data.tags
    assert said and not [line for line in said if "could not close" in line]  # said: the trial's line came


def test_a_bug_in_the_tracker_stops_two_workers_loudly(synthetic, tmp_path):
    # The review's case: a TypeError while a trial's epoch metrics are logged, `study run --workers 2`.
    state, name = tmp_path / "state", "trackerbug"
    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    sf = study_file(tmp_path, name, n_trials=4, epochs=1)
    proc = subprocess.run([sys.executable, "-m", "latentsweep", "study", "run", str(sf), "--data", str(synthetic),
                           "--state-dir", str(state), "--workers", "2", "--quiet", "--tracking-uri", tracking],
                          capture_output=True, text=True, timeout=600, env=fault_kit.hook_env(tmp_path, "epoch:bug:*"),
                          cwd=ROOT)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" in proc.stderr and "TypeError: injected bug in epoch" in proc.stderr
    assert "halted: trial" in proc.stderr.strip().splitlines()[-1]
    states = [t.state.name for t in study(state, name).trials]
    assert 1 <= states.count("FAIL") <= 2 and set(states) <= {"FAIL"}  # a bug is never retried
    statuses = {n: r.info.status for n, r in runs(tracking, name).items()}
    assert "RUNNING" not in statuses.values(), statuses


def test_train_and_pick_jobs_say_a_memory_failure_in_one_line_and_raise_a_bug(synthetic, tmp_path, monkeypatch,
                                                                              capsys):
    from latentsweep.search.pick.jobs import Job, run_job
    from latentsweep.trainers.config.tree import Config, with_values
    from latentsweep.trainers.data.sets import load_train

    sf = study_file(tmp_path, "onejob", epochs=1)
    fail_in_loss(monkeypatch, [lambda: torch.empty(1 << 50)])
    assert main(["train", str(sf), "--data", str(synthetic), "--out", str(tmp_path / "train"), "--quiet"]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("latentsweep: error: RuntimeError: ") and CPU_ALLOCATION in line  # a config too big

    cfg = with_values(Config(), {"train.epochs": 1, "train.batch_size": 64, "loss.infonce.weight": 1.0})
    job = Job("m/fold-1", "m", cfg, None, tmp_path / "job", None)
    fail_in_loss(monkeypatch, [lambda: torch.empty(1 << 50), TypeError("injected bug in a loss")])
    with pytest.raises(Exception, match="pick job m/fold-1: RuntimeError: .*DefaultCPUAllocator") as info:
        run_job(job, load_train(synthetic), progress=False)
    assert classify(info.value.__cause__).kind is Kind.MEMORY and "\n" not in str(info.value)
    with pytest.raises(TypeError, match="injected bug in a loss"):  # a bug keeps its class and traceback
        run_job(job, load_train(synthetic), progress=False)
