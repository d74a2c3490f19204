"""A bug in our code stops the study loudly (trial FAIL, run FAILED, other workers stop); a configuration's own
failures (a bad value found at run time, divergence, out of memory) stay FAIL trials and the study goes on."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
import torch
from mlflow import MlflowClient

from conftest import tiny_study_file as study_file
from latentsweep.search.cli.main import main
from latentsweep.trainers.core.errors import ConfigError
from latentsweep.trainers.train.loop import TrainingDiverged
from latentsweep.trainers.data.synthetic import write_synthetic

ROOT = Path(__file__).resolve().parents[1]
# Imported by every Python process that has it on its path, spawned workers included: a regression in a loss.
BROKEN_LOSS = """
from latentsweep.trainers.losses.core import InfoNCE

def terms(self, out, batch, temperature):
    raise TypeError("injected bug in a loss")

InfoNCE.terms = terms
"""


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> Path:
    train, _, _ = write_synthetic(tmp_path_factory.mktemp("syn"), 120, dim_text=8, dim_image=12, n_test=20)
    return train


def study(state: Path, name: str) -> optuna.Study:
    return optuna.load_study(study_name=name, storage=f"sqlite:///{state / 'optuna.db'}")


def runs(state: Path, name: str) -> dict[str, str]:
    client = MlflowClient(f"sqlite:///{state / 'mlflow.db'}")
    exp = client.get_experiment_by_name(name)
    return {r.info.run_name: r.info.status for r in client.search_runs([exp.experiment_id])}


def test_a_bug_in_a_loss_stops_every_worker_after_one_trial_each(synthetic, tmp_path):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(BROKEN_LOSS)
    state = tmp_path / "state"
    sf = study_file(tmp_path, "buggy", n_trials=8)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hook), str(ROOT)])}
    proc = subprocess.run([sys.executable, "-m", "latentsweep", "study", "run", str(sf), "--data", str(synthetic),
                           "--state-dir", str(state), "--workers", "2", "--quiet"],
                          capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode != 0
    assert "Traceback" in proc.stderr and "TypeError: injected bug in a loss" in proc.stderr
    assert "halted: trial" in proc.stderr.strip().splitlines()[-1]
    trials = study(state, "buggy").trials
    states = [t.state.name for t in trials]
    assert 1 <= states.count("FAIL") <= 2 and set(states) <= {"FAIL", "WAITING"}  # no retry of a bug, nothing RUNNING
    assert all("TypeError: injected bug" in t.user_attrs["latentsweep.error"] for t in trials if t.state.name == "FAIL")
    statuses = runs(state, "buggy")
    assert "RUNNING" not in statuses.values()
    assert [s for n, s in statuses.items() if n.startswith("trial-")] == ["FAILED"] * states.count("FAIL")
    # the user fixes the bug and runs the study again: it resumes
    assert main(["study", "run", str(sf), "--data", str(synthetic), "--state-dir", str(state), "--quiet",
                 "--n-trials", str(states.count("FAIL") + 1)]) == 0
    assert study(state, "buggy").trials[-1].state.name == "COMPLETE"


def test_configuration_failures_are_fail_trials_and_the_study_goes_on(synthetic, tmp_path, monkeypatch, capsys):
    import latentsweep.search.study.objective

    real, calls = latentsweep.search.study.objective.train, []
    failures = [ConfigError("loss.queue.size must divide the batch size"),
                TrainingDiverged("loss is not finite at epoch 1"), torch.OutOfMemoryError("CUDA out of memory")]

    def train(*args, **kwargs):
        calls.append(1)
        if len(calls) <= len(failures):
            raise failures[len(calls) - 1]
        return real(*args, **kwargs)

    monkeypatch.setattr(latentsweep.search.study.objective, "train", train)
    state = tmp_path / "state"
    sf = study_file(tmp_path, "configfail", n_trials=4, epochs=1)
    assert main(["study", "run", str(sf), "--data", str(synthetic), "--state-dir", str(state), "--quiet"]) == 0
    trials = study(state, "configfail").trials
    assert [t.state.name for t in trials] == ["FAIL", "FAIL", "FAIL", "COMPLETE"]
    assert [t.user_attrs["latentsweep.error"] for t in trials[:3]] == [
        "loss.queue.size must divide the batch size", "loss is not finite at epoch 1",
        "OutOfMemoryError: CUDA out of memory"]
    assert not study(state, "configfail").user_attrs.get("latentsweep.halted")
    assert "RUNNING" not in runs(state, "configfail").values()


def test_a_missing_tracked_checkpoint_is_skipped_with_the_reason(tmp_path, capsys):
    from latentsweep.search.pick.candidates import fetch_checkpoint
    from latentsweep.search.tracking import make_tracker

    tracker = make_tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", str(tmp_path / "artifacts"))
    tracker.ensure_study("nockpt", {})
    run_id = tracker.start_trial(0, {}, {})
    tracker.end_trial(run_id, "COMPLETE")
    trial = optuna.trial.create_trial(value=0.5, user_attrs={"mlflow_run_id": run_id, "checkpoint": "gone/best.pt"})
    assert fetch_checkpoint(trial, tracker, tmp_path / "dl", root=tmp_path) is None
    line = capsys.readouterr().err.strip().splitlines()[-1]
    # the exception's message, not only its class name (create_trial numbers a free-standing trial -1)
    assert line.startswith(f"latentsweep: warning: trial -1 skipped: gone/best.pt is missing and MLflow run {run_id} "
                           f"has no best.pt (")
    assert "Failed to download artifacts from path 'best.pt'" in line


# A store failing mid-trial (a real outage of MLflow's store, not a patched method): tests/test_failures.py.
