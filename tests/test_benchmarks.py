"""Every script in benchmarks/ keeps running: its --help (no side effects) and its --smoke (the real code path on tiny
synthetic data, in a temp dir) as subprocesses, one case per file found, so a new script is covered by itself."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py"))
# Smoke runs of 14 s to a minute in .ci/run's slow step on a busy 2-core machine: most start the CLI in
# subprocesses (a study run, workers, picks: torch, Optuna and MLflow imported each time); knob_cost and
# search_efficiency train dozens of configs; gpu.py's smoke (14 s, its compiled step left to tests/test_capture.py)
# also runs throughput's code path; trial_costs runs a study. The suite's 8 minutes on 2 cores keep them out;
# .ci/run's slow step runs them. A script not listed here (a new one) runs in the suite.
SLOW = {"end_to_end.py", "ensemble_size.py", "full_search.py", "gpu.py", "knob_ab.py", "knob_cost.py",
        "memory_peak.py", "one_budget.py", "portfolio.py", "screenshots.py", "search_efficiency.py", "seed_repro.py",
        "throughput.py", "warm_start.py",
        "trial_costs.py", "workers.py"}


def _run(script: str, arg: str, tmp_path: Path, timeout: float) -> tuple[subprocess.CompletedProcess, Path, Path]:
    """`python benchmarks/SCRIPT ARG` from an empty directory, with its own empty TMPDIR."""
    cwd, tmp = tmp_path / "cwd", tmp_path / "tmp"
    cwd.mkdir()
    tmp.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp), "TQDM_DISABLE": "1",
           "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true"}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), arg], cwd=cwd, env=env,
                         capture_output=True, text=True, timeout=timeout)
    return run, cwd, tmp


def _case(script: str):
    return pytest.param(script, marks=pytest.mark.slow) if script in SLOW else script


def test_scripts_are_found():
    assert len(SCRIPTS) >= 16 and "gpu.py" in SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_has_no_side_effects(script, tmp_path):
    run, cwd, tmp = _run(script, "--help", tmp_path, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "usage:" in run.stdout and "--smoke" in run.stdout
    assert list(cwd.iterdir()) == [] and list(tmp.iterdir()) == []


@pytest.mark.parametrize("script", [_case(s) for s in SCRIPTS])
def test_smoke_runs_in_a_temp_dir(script, tmp_path):
    run, cwd, tmp = _run(script, "--smoke", tmp_path, timeout=400)
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-3000:])
    assert run.stdout.strip()  # it reports something
    assert list(cwd.iterdir()) == []  # nothing written where it was started
    # its temp dirs are removed. Caches may stay, under TMPDIR by design: torch's compile cache, the train files'
    # mapped copy (latentsweep.trainers.data.sets.cache_dir: the next process on this machine maps it instead of parsing
    # the file) and the empty MLflow store new ones are copied from (latentsweep.search.tracking.schema)
    caches = ("torchinductor", "latentsweep-data-", "latentsweep-mlflow-")
    assert [p.name for p in tmp.iterdir() if not p.name.startswith(caches)] == []


def test_gpu_benchmark_counts_trials_from_the_first_start(tmp_path, monkeypatch):
    """benchmarks/gpu.py's part (b) counts COMPLETE or PRUNED trials ended within the window of the first trial's
    start, those after STEADY_AFTER_S apart, FAIL ones on their own, and the median epoch of those that timed one."""
    import datetime as dt

    import optuna

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu

    storage = f"sqlite:///{tmp_path / 'o.db'}"
    study = optuna.create_study(study_name="full", storage=storage, direction="maximize")
    t0 = dt.datetime(2026, 11, 28, 6, 0, 0)
    # (state, start s, end s, epoch s): one ends before 30 s, two after it, one FAIL, one past the 90-s window
    for state, start, end, epoch in [("COMPLETE", 0, 20, 1.0), ("PRUNED", 5, 40, 3.0), ("PRUNED", 10, 80, 2.0),
                                     ("FAIL", 12, 60, None), ("COMPLETE", 15, 95, 9.0)]:
        study.add_trial(optuna.trial.FrozenTrial(
            number=0, trial_id=0, state=optuna.trial.TrialState[state], value=0.5 if state != "FAIL" else None,
            values=None, datetime_start=t0 + dt.timedelta(seconds=start),
            datetime_complete=t0 + dt.timedelta(seconds=end), params={}, distributions={},
            user_attrs={"timing": {"train_s": epoch}} if epoch else {}, system_attrs={}, intermediate_values={}))
    got = gpu.finished_within(storage, 90)
    assert (got.ok, got.failed, got.steady, got.size, got.epoch_s) == (3, 1, 2, 1, 2.0)
    assert gpu.finished_within(storage, 30).ok == 1
