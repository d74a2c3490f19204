"""Every pick path keeps its budget: a job starts only while its expected seconds fit, so the pick overruns by at most
the one job that was running. The real clock runs; only the jobs' training is slowed (each takes JOB_S longer than its
trial said), below the budget logic under test."""
from __future__ import annotations

import json
import time
import types

import pytest

import latentsweep.search.pick.jobs as jobs_mod
from conftest import tiny_study_file
from latentsweep.search.cli.main import main
from latentsweep.trainers.data.synthetic import write_synthetic

JOB_S = 3.0  # what each pick job takes here, far more than the tiny trials' measured seconds predict
BUDGET_S = 16.0
STUDY = "budgeted"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("budget")
    train, test, _ = write_synthetic(root / "data", 240, dim_text=24, dim_image=32, n_test=100)
    study = tiny_study_file(root, STUDY, n_trials=4, epochs=2)
    state = root / "state"
    assert main(["study", "run", str(study), "--state-dir", str(state), "--data", str(train), "--quiet"]) == 0
    return types.SimpleNamespace(root=root, state=state, train=train, test=test, study=study)


@pytest.fixture
def slow_jobs(monkeypatch):
    """Each pick job (a refit, fold model or seed re-run) takes JOB_S seconds more than its real training."""
    real = jobs_mod.train

    def slow(*args, **kwargs):
        time.sleep(JOB_S)
        return real(*args, **kwargs)

    monkeypatch.setattr(jobs_mod, "train", slow)


PATHS = {
    "default": [],
    "halves-seed-reruns": ["--selection", "halves", "--no-refit", "--seeds", "3"],
    "no-refit": ["--no-refit"],
    "oof": ["--selection", "oof", "--folds", "3", "--seeds", "3"],
}


@pytest.mark.slow
@pytest.mark.parametrize("path", PATHS)
def test_every_pick_path_overruns_its_budget_by_at_most_one_job(world, slow_jobs, capsys, path):
    out = world.root / path / "submission.csv"
    start = time.monotonic()
    assert main(["pick", STUDY, "--state-dir", str(world.state), "--budget", str(BUDGET_S), "--out", str(out),
                 "--quiet", *PATHS[path]]) == 0
    wall = time.monotonic() - start
    err = capsys.readouterr().err
    # one job's overrun, and a second of slack for the process around it (argument parsing, imports)
    assert wall <= BUDGET_S + JOB_S + 1.0, err
    manifest = json.loads(out.with_name("submission.manifest.json").read_text())
    assert manifest["submission_models"]
    if path != "no-refit":  # the slowed jobs ran: the budget, not the plan, stopped them
        assert "job 1/" in err and "budget" in err


@pytest.mark.slow
def test_the_one_budget_run_keeps_its_time_and_stops_the_running_trial(world, slow_jobs, capsys, tmp_path):
    """`latentsweep run` with a study whose trials are too long for the budget: the trial running when the search's
    share ends stops there with its best epoch kept (pruned, its checkpoint on disk), and the pick that follows uses
    it; the whole run ends within the budget plus one job."""
    import optuna

    from latentsweep.search.study.objective import DEADLINE_ATTR

    long = tiny_study_file(tmp_path, "long", n_trials=50, epochs=4000)
    total = 60.0
    start = time.monotonic()
    assert main(["run", str(long), "--time", f"{total:.0f}", "--data", str(world.train), "--test", str(world.test),
                 "--state-dir", str(tmp_path / "state"), "--quiet"]) == 0
    wall = time.monotonic() - start
    out = capsys.readouterr()
    assert wall <= total + JOB_S + 1.0, out.err
    assert out.err.index("run: 60 s in all") < out.err.index("trial 0")  # the split is said before any work
    study = optuna.load_study(study_name="long", storage=f"sqlite:///{tmp_path / 'state' / 'optuna.db'}")
    stopped = [t for t in study.trials if DEADLINE_ATTR in t.user_attrs]
    assert len(stopped) == 1 and stopped[0].state == optuna.trial.TrialState.PRUNED
    assert (tmp_path / "state" / stopped[0].user_attrs["out_dir"] / "best.pt").is_file()
    assert "registered long v1" in out.out
