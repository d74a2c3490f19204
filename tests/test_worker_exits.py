"""Every exit path of a worker closes what it owns (trial, MLflow run, parent run); resume continues the search;
`study reap` never changes a finished study. Real Optuna on SQLite, real MLflow on SQLite."""
from __future__ import annotations

import sqlite3
from pathlib import Path

import optuna
import pytest
from mlflow import MlflowClient

from conftest import tiny_study_file as study_file
from latentsweep.search.cli.main import main
from latentsweep.trainers.data.synthetic import write_synthetic


@pytest.fixture(scope="module")
def state(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("state")


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> Path:
    train, _, _ = write_synthetic(tmp_path_factory.mktemp("syn"), 120, dim_text=8, dim_image=12, n_test=20)
    return train


def run(sf: Path, state: Path, synthetic: Path, *extra: str) -> int:
    return main(["study", "run", str(sf), "--data", str(synthetic), "--state-dir", str(state), "--quiet", *extra])


def trials(state: Path, name: str) -> list[optuna.trial.FrozenTrial]:
    return optuna.load_study(study_name=name, storage=f"sqlite:///{state / 'optuna.db'}").get_trials()


def runs(state: Path, name: str) -> dict[str, str]:
    """MLflow run name -> status for the study's experiment (parent and trials)."""
    client = MlflowClient(f"sqlite:///{state / 'mlflow.db'}")
    exp = client.get_experiment_by_name(name)
    return {r.info.run_name: r.info.status for r in client.search_runs([exp.experiment_id])}


def assert_nothing_running(state: Path, name: str) -> None:
    assert [t.number for t in trials(state, name) if t.state.name == "RUNNING"] == []
    assert [n for n, s in runs(state, name).items() if s == "RUNNING"] == []


def test_full_disk_before_training_fails_and_retries_the_trial(state, synthetic, tmp_path, monkeypatch, capsys):
    import latentsweep.search.study.objective

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device", "config.toml")

    monkeypatch.setattr(latentsweep.search.study.objective, "dump_toml", full)
    sf = study_file(tmp_path, "fulldisk", n_trials=2)
    assert run(sf, state, synthetic) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("latentsweep: error: trial 0: cannot write config.toml: No space left on device; the trial is "
                       "retried when the study runs again")
    assert [t.state.name for t in trials(state, "fulldisk")] == ["FAIL", "WAITING"]  # retried, not counted
    assert_nothing_running(state, "fulldisk")
    assert runs(state, "fulldisk") == {"study-fulldisk": "FINISHED"}  # no trial run was opened


def test_error_after_the_run_started_closes_the_run(state, synthetic, tmp_path, monkeypatch, capsys):
    import latentsweep.search.study.objective

    def dies(*args, **kwargs):
        raise SystemExit(3)  # not an Exception: passes the trial's own `except Exception`

    monkeypatch.setattr(latentsweep.search.study.objective, "train", dies)
    sf = study_file(tmp_path, "sysexit", n_trials=2)
    with pytest.raises(SystemExit):
        run(sf, state, synthetic)
    assert [t.state.name for t in trials(state, "sysexit")] == ["FAIL", "WAITING"]
    assert_nothing_running(state, "sysexit")
    assert runs(state, "sysexit")["trial-0"] == "KILLED"


def test_interrupt_between_claim_and_run_fails_the_claimed_trial(state, synthetic, tmp_path, monkeypatch, capsys):
    import latentsweep.search.study.worker

    calls = []
    real = latentsweep.search.study.worker.close_dead_runs

    def interrupted(*args, **kwargs):  # the first call is the start-up reap, the second follows the first claim
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(latentsweep.search.study.worker, "close_dead_runs", interrupted)
    sf = study_file(tmp_path, "claimint", n_trials=2)
    assert run(sf, state, synthetic) == 130
    assert [t.state.name for t in trials(state, "claimint")] == ["FAIL", "WAITING"]
    assert_nothing_running(state, "claimint")


def test_dead_workers_trials_are_reaped_by_owner_at_once(state, synthetic, tmp_path):
    from latentsweep.search.cli.main import build_parser
    from latentsweep.search.cli.study import make_spec
    from latentsweep.search.study.studyfile import load_study_file
    from latentsweep.search.study.worker import claim_trial, dispose_study, load_or_create, reap_owner, worker_id
    from latentsweep.search.tracking import make_tracker

    sf = study_file(tmp_path, "owner", n_trials=2)
    args = build_parser().parse_args(["study", "run", str(sf), "--data", str(synthetic), "--state-dir", str(state)])
    spec = make_spec(args)
    tracker = make_tracker(spec.tracking_uri, spec.artifact_root)
    study = load_or_create(load_study_file(sf), spec, tracker)
    trial = claim_trial(study, spec.n_trials)
    assert trial is not None and study.trials[0].user_attrs["latentsweep.worker"] == worker_id()
    assert reap_owner(study, tracker, "elsewhere:1") == [] and study.trials[0].state.name == "RUNNING"
    reap_owner(study, tracker, worker_id())  # well within the heartbeat grace period
    assert [t.state.name for t in study.trials] == ["FAIL", "WAITING"]
    dispose_study(study)


def test_worker_command_closes_the_parent_run_when_done(state, synthetic, tmp_path, capsys):
    sf = study_file(tmp_path, "lastworker", n_trials=1)
    base = [str(sf), "--data", str(synthetic), "--state-dir", str(state), "--quiet"]
    assert main(["study", "create", *base]) == 0
    assert runs(state, "lastworker") == {"study-lastworker": "FINISHED"}  # create runs no trial: nothing left open
    assert main(["worker", *base]) == 0
    assert runs(state, "lastworker") == {"study-lastworker": "FINISHED", "trial-0": "FINISHED"}


def test_resume_continues_the_search_instead_of_replaying_it(state, synthetic, tmp_path, capsys):
    sf = study_file(tmp_path, "resume", n_trials=1, epochs=1)
    assert run(sf, state, synthetic) == 0
    assert run(sf, state, synthetic, "--n-trials", "2") == 0
    first, second = trials(state, "resume")
    assert first.params["optim.lr"] != second.params["optim.lr"]


def test_reap_leaves_a_finished_study_unchanged(state, synthetic, tmp_path, capsys):
    sf = study_file(tmp_path, "reapdone", n_trials=1, epochs=1)
    assert run(sf, state, synthetic) == 0
    before_runs = runs(state, "reapdone")
    before_attrs = optuna.load_study(study_name="reapdone", storage=f"sqlite:///{state / 'optuna.db'}").user_attrs
    assert main(["study", "reap", str(sf), "--state-dir", str(state)]) == 0
    assert runs(state, "reapdone") == before_runs and set(before_runs.values()) == {"FINISHED"}
    assert optuna.load_study(study_name="reapdone",
                             storage=f"sqlite:///{state / 'optuna.db'}").user_attrs == before_attrs


def test_interrupt_between_trials_of_a_lone_worker_still_closes_the_parent_run(state, synthetic, tmp_path,
                                                                                 monkeypatch, capsys):
    """A Ctrl-C landing in a store call between trials (here: while a connection holds MLflow's write lock) must not
    keep that lock through the worker's exit, where the last worker out closes the study's parent run."""
    import latentsweep.search.study.worker

    sf = study_file(tmp_path, "idleint", n_trials=2)
    base = [str(sf), "--data", str(synthetic), "--state-dir", str(state), "--quiet"]
    assert main(["study", "create", *base]) == 0
    real = latentsweep.search.study.worker.check_halted
    calls = []

    def interrupted_in_a_write(study):  # the second check follows trial 0
        calls.append(1)
        if len(calls) == 2:
            held = sqlite3.connect(state / "mlflow.db", isolation_level=None)
            held.execute("BEGIN IMMEDIATE")  # only this frame references it, as in an interrupted MLflow write
            raise KeyboardInterrupt
        return real(study)

    monkeypatch.setattr(latentsweep.search.study.worker, "check_halted", interrupted_in_a_write)
    assert main(["worker", *base]) == 130
    assert runs(state, "idleint") == {"study-idleint": "FINISHED", "trial-0": "FINISHED"}, capsys.readouterr().err


@pytest.mark.parametrize("command", ["worker", "study run"])
def test_an_interrupt_that_cut_an_import_short_still_ends_in_one_line(state, synthetic, tmp_path, monkeypatch, capsys,
                                                                     command):
    """A SIGTERM inside a trial can land in matplotlib's first import, leaving a half-made module that fails on its
    next import: closing the study after an interrupt draws no figures (the next run draws them), so the worker ends
    with the interrupt's exit code, not that import's traceback."""
    import sys
    import types

    import latentsweep.search.study.objective

    cut = tmp_path / "cut" / "matplotlib"  # a package whose __init__ stopped half-way: its submodules fail as in CI
    cut.mkdir(parents=True)
    for sub in ("pyplot", "figure"):
        (cut / f"{sub}.py").write_text("import matplotlib\nmatplotlib.get_data_path()\n")
    half = types.ModuleType("matplotlib")
    half.__path__ = [str(cut)]

    def interrupted(*args, **kwargs):
        monkeypatch.setitem(sys.modules, "matplotlib", half)
        for sub in ("pyplot", "figure"):
            monkeypatch.delitem(sys.modules, f"matplotlib.{sub}", raising=False)
        raise KeyboardInterrupt

    monkeypatch.setattr(latentsweep.search.study.objective, "train", interrupted)
    name = "cutimport" + command.replace(" ", "")
    sf = study_file(tmp_path, name, n_trials=2)
    base = [str(sf), "--data", str(synthetic), "--state-dir", str(state), "--quiet"]
    assert main(["study", "create", *base]) == 0
    assert main([*command.split(), *base]) == 130
    assert_nothing_running(state, name)
    assert runs(state, name)[f"study-{name}"] == "FINISHED", capsys.readouterr().err


def test_a_stop_inside_the_samplers_ask_leaves_no_trial_running(state, synthetic, tmp_path):
    """SIGINT while Optuna's ask() samples (its trial row already made): the stop waits until the claim holds the
    trial, which is then failed; before, ask() was cut short and its trial stayed RUNNING with no heartbeat, for good
    (Optuna never counts such a trial as stale)."""
    import os
    import signal
    import time

    from latentsweep.search.cli.main import build_parser
    from latentsweep.search.cli.study import make_spec
    from latentsweep.search.process import interrupt_on
    from latentsweep.search.study.studyfile import load_study_file
    from latentsweep.search.study.worker import claim_trial, dispose_study, load_or_create
    from latentsweep.search.tracking import make_tracker

    class Interrupted(optuna.samplers.RandomSampler):
        def before_trial(self, study, trial):  # inside ask(), after its trial row was made
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)  # the handler runs here unless the signal is held back

    sf = study_file(tmp_path, "askint", n_trials=2)
    args = build_parser().parse_args(["study", "run", str(sf), "--data", str(synthetic), "--state-dir", str(state)])
    spec = make_spec(args)
    study = load_or_create(load_study_file(sf), spec, make_tracker(spec.tracking_uri, spec.artifact_root))
    study.sampler = Interrupted()
    with pytest.raises(KeyboardInterrupt), interrupt_on(signal.SIGINT):
        claim_trial(study, spec.n_trials)
    assert [t.state.name for t in study.trials] == ["FAIL"]
    dispose_study(study)
