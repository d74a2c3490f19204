"""Tracking: MlflowTracker against a real SQLite MLflow store, InMemoryTracker, redaction helpers and figures."""
from __future__ import annotations

import time

import matplotlib.pyplot as plt
import numpy as np
import optuna
import pytest

from latentsweep.search.tracking import make_tracker, plots
from latentsweep.search.study.report import study_summary
from latentsweep.search.redact import redact_url, redact_values
from latentsweep.search.tracking.base import PARAM_VALUE_MAX
from latentsweep.search.tracking.memory import InMemoryTracker
from latentsweep.search.tracking.mlflow import MlflowTracker
from latentsweep.trainers.core.errors import LatentsweepError

SECRET = "s3cr3t-pw"
PG_URL = f"postgresql+psycopg2://alice:{SECRET}@db.example:5432/optuna"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One MLflow SQLite store per module: creating its schema takes 10-30 s, so tests share it (distinct studies)."""
    root = tmp_path_factory.mktemp("mlflow")
    return f"sqlite:///{root / 'mlflow.db'}", (root / "artifacts").as_uri()


@pytest.fixture(scope="module")
def tracker(store):
    return MlflowTracker(*store)


@pytest.fixture
def batch_limits(tracker, monkeypatch):
    """Fail a log_batch over the per-request limits a tracking server enforces (the SQLite store does not check)."""
    real = tracker.client.log_batch
    calls = []

    def checked(run_id, metrics=(), params=(), tags=(), **kwargs):
        assert len(params) <= 100 and len(tags) <= 100 and len(metrics) <= 1000
        assert len(params) + len(tags) + len(metrics) <= 1000
        calls.append((len(params), len(tags), len(metrics)))
        return real(run_id, metrics=metrics, params=params, tags=tags, **kwargs)

    monkeypatch.setattr(tracker.client, "log_batch", checked)
    return calls


def _study(n_complete: int, vary: bool = True) -> optuna.Study:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name="plots", sampler=optuna.samplers.RandomSampler(seed=0))
    for i in range(n_complete):
        study.enqueue_trial({"x": 0.1 * i if vary else 0.5, "k": "a"})
    study.optimize(lambda t: (t.suggest_float("x", 0, 1) - 0.3) ** 2 + (t.suggest_categorical("k", ["a"]) == "a"),
                   n_trials=n_complete)
    return study


# ---------------------------------------------------------------- helpers (no MLflow)


def test_redact_url_hides_passwords_only():
    assert redact_url("postgresql+psycopg2://user:secret@host/db") == "postgresql+psycopg2://user:***@host/db"
    assert redact_url("mysql://:pw@h:3306/d") == "mysql://:***@h:3306/d"
    assert redact_url("x=http://u:p@ss/word@h:5/db?a=1 y") == "x=http://u:***@h:5/db?a=1 y"
    assert redact_url("postgresql://u:p@ss@h/db") == "postgresql://u:***@h/db"  # SQLAlchemy would show "ss"
    for plain in ("http://host:8080/path", "sqlite:////tmp/a.db", "http://user@host/", "not a url"):
        assert redact_url(plain) == plain


def test_redact_values_masks_urls_and_secret_keys():
    values = {"storage": PG_URL, "db.password": "hunter2", "s3/aws_secret_key": "k", "model.n_token": 4, "lr": 0.1}
    assert redact_values(values) == {"storage": PG_URL.replace(SECRET, "***"), "db.password": "***",
                                     "s3/aws_secret_key": "***", "model.n_token": 4, "lr": 0.1}


def test_make_tracker_memory_and_derived_artifact_root(tmp_path):
    assert isinstance(make_tracker("memory"), InMemoryTracker)
    from latentsweep.search.tracking.paths import default_artifact_root

    assert default_artifact_root(f"sqlite:///{tmp_path}/m.db") == (tmp_path / "artifacts").as_uri()
    assert default_artifact_root("http://localhost:5000") is None


# ---------------------------------------------------------------- InMemoryTracker


def test_in_memory_tracker_records_runs(tmp_path):
    tr = InMemoryTracker()
    parent = tr.ensure_study("s", {"sampler": "tpe", "storage": PG_URL})
    assert tr.ensure_study("s", {"sampler": "tpe"}) == parent
    assert tr.runs[parent]["params"]["storage"] == PG_URL.replace(SECRET, "***")
    runs = [tr.start_trial(i, {"optim": {"lr": 0.1 * (i + 1)}}, {"seed": i}) for i in range(3)]
    assert tr.runs[runs[0]]["name"] == "trial-0" and tr.runs[runs[0]]["params"] == {"optim.lr": "0.1"}
    assert tr.runs[runs[1]]["tags"]["mlflow.parentRunId"] == parent
    for step in range(3):
        tr.log(runs[0], metrics={"val/mrr": 0.1 * step}, step=step)
    assert tr.runs[runs[0]]["metrics"]["val/mrr"] == [(0, 0.0), (1, 0.1), (2, 0.2)]
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "model.pt").write_bytes(b"x")
    tr.log_artifacts(runs[0], [tmp_path / "ckpt"], "out")
    assert tr.runs[runs[0]]["artifacts"] == ["out/ckpt/model.pt"]
    tr.end_trial(runs[0], "COMPLETE")
    tr.end_trial(runs[1], optuna.trial.TrialState.PRUNED)
    assert [tr.runs[r]["status"] for r in runs] == ["FINISHED", "FINISHED", "RUNNING"]  # pruned: by design
    assert tr.runs[runs[1]]["tags"]["optuna.state"] == "PRUNED"
    assert tr.close_stale_runs(alive_numbers=set()) == [runs[2]]
    assert tr.runs[runs[2]]["tags"]["latentsweep.reaped"] == "true"
    tr.log(runs[1], params={"extra": 1}, tags={"note": "n"})
    assert tr.runs[runs[1]]["params"]["extra"] == "1" and tr.runs[runs[1]]["tags"]["note"] == "n"
    tr.end_study({"trials_complete": 1, "trials_finished": 3, "best_params": {"optim.lr": 0.1}}, {})
    assert tr.runs[parent]["status"] == "FINISHED" and tr.runs[parent]["tags"]["best.optim.lr"] == "0.1"
    assert tr.runs[parent]["metrics"]["trials_complete"] == [(3, 1.0)]


# ---------------------------------------------------------------- MlflowTracker on SQLite


def test_ensure_study_is_idempotent_across_instances(store, tracker):
    parent = tracker.ensure_study("idem study", {"sampler": "tpe", "n_trials": 5})
    other = MlflowTracker(*store)
    assert other.ensure_study("idem study", {"sampler": "tpe", "n_trials": 9}) == parent
    other.attach_study("idem study", parent)
    client = tracker.client
    exps = [e for e in client.search_experiments() if e.name == "idem study"]
    assert len(exps) == 1
    assert exps[0].artifact_location == f"{store[1]}/idem_study"
    parents = client.search_runs([exps[0].experiment_id], "tags.`latentsweep.role` = 'parent'")
    assert [r.info.run_id for r in parents] == [parent]
    run = client.get_run(parent)
    assert run.info.run_name == "study-idem study" and run.info.status == "RUNNING"
    assert run.data.params == {"sampler": "tpe", "n_trials": "5"}  # params are immutable: the change is a tag
    assert run.data.tags["setting.n_trials"] == "9"
    assert run.data.tags["latentsweep.study"] == "idem study"


def test_attach_unknown_parent_raises(tracker):
    tracker.ensure_study("attach study", {})
    with pytest.raises(LatentsweepError, match="not found"):
        MlflowTracker(tracker.tracking_uri, tracker.artifact_root).attach_study("attach study", "0" * 32)


def test_start_trial_creates_nested_running_run(tracker, batch_limits):
    parent = tracker.ensure_study("trial study", {})
    params = {f"p{i:03d}": i for i in range(150)}  # more than one log_batch (100 params per request)
    params["long"] = "v" * (PARAM_VALUE_MAX + 10)
    run_id = tracker.start_trial(0, params, {"device": "cpu", "mlflow.parentRunId": "spoofed"})
    run = tracker.client.get_run(run_id)
    assert run.info.run_name == "trial-0" and run.info.status == "RUNNING"
    assert run.data.tags["mlflow.parentRunId"] == parent
    assert run.data.tags["optuna.trial_number"] == "0" and run.data.tags["latentsweep.role"] == "trial"
    assert run.data.tags["device"] == "cpu"
    assert len(run.data.params) == 151 and run.data.params["p149"] == "149"
    assert sum(p for p, _, _ in batch_limits) == 151
    assert len(run.data.params["long"]) == PARAM_VALUE_MAX and "truncated" in run.data.params["long"]


def test_log_round_trips_through_metric_history(tracker, batch_limits):
    tracker.ensure_study("epoch study", {})
    run_id = tracker.start_trial(0, {}, {})
    values = [0.25, 0.5, 0.75]
    for step, value in enumerate(values):
        tracker.log(run_id, metrics={"val/mrr": value, "train/loss": 1.0 - value}, step=step)
    tracker.log(run_id, metrics={f"m/{i}": float(i) for i in range(1200)}, step=3)  # > 1000 metrics per request
    history = tracker.client.get_metric_history(run_id, "val/mrr")
    assert [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)] == list(enumerate(values))
    assert tracker.client.get_run(run_id).data.metrics["m/1199"] == 1199.0
    assert sum(m for _, _, m in batch_limits) == 2 * len(values) + 1200


def test_log_raises_what_the_store_raises(tracker, batch_limits):
    # The tracker decides nothing about failures: latentsweep.search.failures classifies what it raises
    # (tests/test_failures.py).
    from mlflow.exceptions import MlflowException

    tracker.ensure_study("flaky study", {})
    run_id = tracker.start_trial(0, {}, {})
    with pytest.raises(MlflowException):
        tracker.log("no-such-run", metrics={"val/mrr": 0.1})
    tracker.log(run_id, metrics={"val/mrr": 0.2}, step=1)
    tracker.end_trial(run_id, "COMPLETE")  # the tracker still works afterwards
    assert tracker.client.get_run(run_id).info.status == "FINISHED"


def test_end_trial_maps_optuna_states(tracker):
    tracker.ensure_study("state study", {})
    expected = {"COMPLETE": "FINISHED", "PRUNED": "FINISHED", "FAIL": "FAILED", "WAITING": "FAILED"}
    for number, (state, status) in enumerate(expected.items()):
        run_id = tracker.start_trial(number, {}, {})
        tracker.end_trial(run_id, getattr(optuna.trial.TrialState, state))
        run = tracker.client.get_run(run_id)
        assert (run.info.status, run.data.tags["optuna.state"]) == (status, state)
        assert run.info.end_time is not None


def test_artifacts_and_figures_are_listed(tracker, tmp_path):
    tracker.ensure_study("artifact study", {})
    run_id = tracker.start_trial(0, {}, {})
    (tmp_path / "config.toml").write_text("x = 1\n")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "model.pt").write_bytes(b"weights")
    tracker.log_artifacts(run_id, [tmp_path / "config.toml", tmp_path / "ckpt"])
    fig = plots.rank_histogram(np.array([1, 1, 2, 5, 40]), "val")
    tracker.log_figure(run_id, fig, "plots/ranks.png")
    client = tracker.client
    assert {f.path for f in client.list_artifacts(run_id)} == {"config.toml", "ckpt", "plots"}
    assert [f.path for f in client.list_artifacts(run_id, "ckpt")] == ["ckpt/model.pt"]
    assert [f.path for f in client.list_artifacts(run_id, "plots")] == ["plots/ranks.png"]
    assert client.get_run(run_id).info.artifact_uri.startswith(f"{tracker.artifact_root}/artifact_study/")
    with pytest.raises(LatentsweepError, match="does not exist"):
        tracker.log_artifacts(run_id, [tmp_path / "missing.bin"])


def test_close_stale_runs_only_closes_dead_running_trials(tracker):
    tracker.ensure_study("reap study", {})
    ids = [tracker.start_trial(i, {}, {}) for i in range(4)]
    tracker.end_trial(ids[0], "COMPLETE")
    closed = tracker.close_stale_runs(alive_numbers={2})
    assert sorted(closed) == sorted([ids[1], ids[3]])
    runs = {i: tracker.client.get_run(r) for i, r in enumerate(ids)}
    assert [runs[i].info.status for i in range(4)] == ["FINISHED", "FAILED", "RUNNING", "FAILED"]
    assert runs[1].data.tags["latentsweep.reaped"] == "true" and "latentsweep.reaped" not in runs[2].data.tags
    assert tracker.close_stale_runs(alive_numbers={2}) == []


def test_secrets_never_reach_mlflow(tracker):
    parent = tracker.ensure_study("secret study", {"storage": PG_URL, "auth.password": SECRET})
    run_id = tracker.start_trial(0, {"data": {"path": PG_URL}}, {"storage": PG_URL})
    tracker.log(run_id, tags={"note": f"copied from {PG_URL}"}, params={"copy": PG_URL})
    for rid in (parent, run_id):
        data = tracker.client.get_run(rid).data
        assert SECRET not in repr(data.params) + repr(data.tags)
    assert tracker.client.get_run(run_id).data.params["data.path"] == PG_URL.replace(SECRET, "***")


def test_end_study_writes_summary_and_plots(tracker):
    parent = tracker.ensure_study("summary study", {})
    study = _study(3)
    summary = study_summary(study)
    assert summary["trials_complete"] == 3 and summary["best_params"] == study.best_params
    figures = plots.study_figures(study)
    # 3 complete trials are too few for importances: left out (see test_importances_need_enough_trials)
    assert set(figures) == {"optimization_history.png", "parallel_coordinate.png"}
    tracker.end_study(summary, figures)
    assert plt.get_fignums() == []  # logged figures are closed
    run = tracker.client.get_run(parent)
    assert run.info.status == "FINISHED"
    assert run.data.metrics["trials_complete"] == 3 and run.data.metrics["trials_fail"] == 0
    # the summary's step is the number of finished trials, so its history shows the study's progress
    assert [m.step for m in tracker.client.get_metric_history(parent, "trials_complete")] == [3]
    assert run.data.metrics["best_value"] == pytest.approx(study.best_value)
    assert run.data.tags["best.x"] == str(study.best_params["x"])
    listed = {f.path for f in tracker.client.list_artifacts(parent, "plots")}
    assert listed == {f"plots/{name}" for name in figures}
    tracker.attach_study("summary study", parent)  # a resumed study runs again
    assert tracker.client.get_run(parent).info.status == "RUNNING"


# ---------------------------------------------------------------- figures


def test_rank_histogram_titles_mrr():
    fig = plots.rank_histogram(np.array([1, 2, 4, 100, 3000]), "global")
    title = fig.axes[0].get_title()
    assert f"MRR {np.mean(1 / np.array([1, 2, 4, 100, 3000])):.4f}" in title and "n=5" in title
    assert "global protocol" in title and "val/mrr_global" in title  # which protocol, next to val/mrr's
    assert "leaderboard protocol" in " ".join(t.get_text() for t in fig.texts)
    assert fig.axes[0].get_xscale() == "log"
    with pytest.raises(ValueError):
        plots.rank_histogram(np.array([0, 1]), "bad")


def test_study_figures_skips_importances_without_variation():
    assert plots.study_figures(_study(0)) == {}
    figures = plots.study_figures(_study(plots.MIN_IMPORTANCE_TRIALS, vary=False))
    assert set(figures) == {"optimization_history.png"}  # no knob varied: nothing to draw per knob
    for fig in figures.values():
        plt.close(fig)


def test_importances_need_enough_trials_and_say_how_many():
    few = plots.study_figures(_study(plots.MIN_IMPORTANCE_TRIALS - 1))
    assert "param_importances.png" not in few
    figures = plots.study_figures(_study(plots.MIN_IMPORTANCE_TRIALS), objective="val/mrr")
    fig = figures["param_importances.png"]
    notes = " ".join(t.get_text() for t in fig.texts)
    assert f"{plots.MIN_IMPORTANCE_TRIALS} complete trials" in notes
    width, height = fig.get_size_inches()
    assert width >= 10 and height >= 5
    ax = fig.axes[0]
    assert "x" in [label.get_text() for label in ax.get_yticklabels()]  # the full knob name, not clipped
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    left = min(label.get_window_extent(renderer).x0 for label in ax.get_yticklabels() if label.get_text())
    assert left >= 0  # tight layout: no tick label is cut at the figure's left edge
    assert "val/mrr" in figures["optimization_history.png"].axes[0].get_ylabel()
    for f in list(figures.values()) + list(few.values()):
        plt.close(f)


LEXER_UNDER_SIGTERM = """
import os, signal
from sqlparse.lexer import Lexer
from latentsweep.search.process import interrupt_on

original = Lexer.default_initialization
def stopped_while_built(self):  # the stop signal comes while sqlparse builds its one lexer's rules
    os.kill(os.getpid(), signal.SIGTERM)
    original(self)
Lexer.default_initialization = stopped_while_built
with interrupt_on(signal.SIGTERM):
    try:
        import latentsweep.search.tracking.mlflow
        print("not interrupted")
    except KeyboardInterrupt:
        print("interrupted")
from mlflow.utils.search_utils import SearchUtils
print(SearchUtils.parse_search_filter("tags.`latentsweep.role` = 'trial' and attributes.status = 'RUNNING'"))
"""


def test_a_stop_signal_while_the_filter_parser_is_built_leaves_it_whole():
    """A SIGTERM while sqlparse builds the lexer MLflow's search filters use stops the process after the lexer is
    whole: the runs are then closed with filters that parse (a half-built lexer read each one as invalid clauses)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", LEXER_UNDER_SIGTERM], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "interrupted"  # the signal still stops: held back, not lost
    assert "latentsweep.role" in lines[1] and "RUNNING" in lines[1], done.stdout
