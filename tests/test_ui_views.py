"""What a user sees in the UIs after a warm-started study: the MLflow trials view (value, state, knobs and warm-start
source as columns), the parent run naming the warm sources, `latentsweep ui` printing each study's trials link, and
the optimization history drawing pruned trials. Real Optuna and MLflow stores on SQLite."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import matplotlib.pyplot as plt
import optuna
import pytest
from mlflow import MlflowClient

from latentsweep.search.cli import ui as cmd_ui
from latentsweep.search.cli.main import SIGPIPE_EXIT
from latentsweep.search.study.contract import PARENT_ATTR, WARM_ATTR
from latentsweep.search.study.report import study_summary
from latentsweep.search.tracking import plots
from latentsweep.search.tracking.base import SHARED_VIEW_PREFIX, TAG_VALUE_MAX, TRIALS_VIEW, trials_view
from latentsweep.search.tracking.mlflow import MlflowTracker
from latentsweep.search.ui import servers
from latentsweep.trainers.data.synthetic import write_synthetic
from test_warm_start import create, earlier_study

VIEW_TAG = SHARED_VIEW_PREFIX + TRIALS_VIEW
KNOBS = ("optim.lr", "loss.triplet.weight", "loss.triplet.margin")  # tests/conftest.py TINY_STUDY's space, in order


@pytest.fixture(scope="module")
def state(tmp_path_factory):
    """A state directory holding study 'earlier' (Optuna only) and 'second', created (`study create`) on the same data,
    so it queued earlier's best configurations with their sources; its MLflow experiment and parent run exist."""
    tmp = tmp_path_factory.mktemp("views")
    train = write_synthetic(tmp / "data", 120, dim_text=16, dim_image=16)[0]
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("LATENTSWEEP_WARM_START", raising=False)  # the product's default: on
        root = earlier_study(tmp, train)
        create(tmp, root, train, "second")
    return root


def second(state) -> optuna.Study:
    return optuna.load_study(study_name="second", storage=f"sqlite:///{state / 'optuna.db'}")


def test_the_trials_view_shows_value_state_warm_source_and_knobs(state):
    client = MlflowClient(f"sqlite:///{state / 'mlflow.db'}")
    view = json.loads(client.get_experiment_by_name("second").tags[VIEW_TAG])
    assert view["selectedColumns"] == ["metrics.`best/val/mrr`", "tags.`optuna.state`", f"tags.`{WARM_ATTR}`",
                                       *(f"params.`search.{k}`" for k in KNOBS)]
    assert view["orderByKey"] == "metrics.`best/val/mrr`" and view["orderByAsc"] is False  # best first
    assert view["searchFilter"] == "tags.`latentsweep.role` = 'trial'"
    parent = client.get_run(second(state).user_attrs[PARENT_ATTR]).data.params
    assert parent["searched"] == ",".join(KNOBS) and "view_tags" not in parent  # presentation is not a param


def test_a_minimized_objective_sorts_ascending_and_a_huge_space_still_fits_one_tag():
    knobs = ",".join(f"block{i}.knob" for i in range(2000))
    text = trials_view({"objective": "val/loss", "direction": "minimize", "searched": knobs})
    view = json.loads(text)  # still JSON: columns were dropped, not characters
    assert len(text) <= TAG_VALUE_MAX and view["orderByAsc"] is True
    assert view["selectedColumns"][:3] == ["metrics.`best/val/loss`", "tags.`optuna.state`",
                                           "params.`search.block0.knob`"]


def test_the_parent_run_names_where_the_warm_started_trials_came_from(state):
    study = second(state)
    summary = study_summary(study)
    assert summary["warm_from"] == "trial 0 <- earlier:0, trial 1 <- earlier:1, trial 2 <- earlier:2, " \
                                   "trial 3 <- earlier:3"
    tracker = MlflowTracker(f"sqlite:///{state / 'mlflow.db'}", (state / "artifacts").as_uri())
    tracker.attach_study("second", study.user_attrs[PARENT_ATTR])
    tracker.end_study(summary, {})
    tags = tracker.client.get_run(study.user_attrs[PARENT_ATTR]).data.tags
    assert tags["summary.warm_from"] == summary["warm_from"]


def test_a_study_without_warm_start_says_nothing_of_it():
    study = optuna.create_study()
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=2)
    assert "warm_from" not in study_summary(study)


@pytest.mark.slow
def test_ui_prints_each_studys_trials_link_and_it_opens_the_view(state, capsys):
    handle = servers.start_ui(state, mlflow_port=servers.free_port(), dashboard_port=servers.free_port())
    try:
        links = servers.trials_links(handle.mlflow_url, cmd_ui.ML_WORKFLOW)
        exp = MlflowClient(f"sqlite:///{state / 'mlflow.db'}").get_experiment_by_name("second").experiment_id
        url = f"{handle.mlflow_url}/#/experiments/{exp}/runs?viewStateShareKey={TRIALS_VIEW}&{cmd_ui.ML_WORKFLOW}"
        assert links == [("second", url)]  # MLflow's Default experiment has no view: no link
        cmd_ui._announce(handle)
        assert f"  trials of second: {url}\n" in capsys.readouterr().out
    finally:
        handle.stop()


def _pruned_study(n_pruned: int) -> optuna.Study:
    """One complete trial, then `n_pruned` pruned after reporting one epoch each (Optuna records that value)."""
    study = optuna.create_study(direction="maximize")

    def objective(trial):
        x = trial.suggest_float("x", 0, 1)
        if trial.number:
            trial.report(0.1 * trial.number, 0)
            raise optuna.TrialPruned()
        return x

    study.optimize(objective, n_trials=1 + n_pruned)
    return study


def test_the_optimization_history_draws_pruned_trials_too():
    study = _pruned_study(4)
    fig = plots.study_figures(study)["optimization_history.png"]
    try:
        ax = fig.axes[0]
        points = [tuple(xy) for c in ax.collections for xy in c.get_offsets().tolist()]
        for n in range(1, 5):  # each pruned trial at its recorded value
            assert any(x == n and y == pytest.approx(0.1 * n) for x, y in points), (n, points)
        labels = [text.get_text() for legend in fig.legends + [ax.get_legend()] if legend for text in legend.texts]
        assert "pruned (value when stopped)" in labels
    finally:
        plt.close(fig)


def test_study_status_into_a_pipe_whose_reader_left_says_no_error(state):
    """`latentsweep study status NAME | head -3`: head leaves after 3 lines, and the rest is not an error."""
    proc = subprocess.Popen([sys.executable, "-m", "latentsweep", "study", "status", "second", "--state-dir",
                             str(state)], cwd=Path(__file__).resolve().parents[1], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # before its first line: the reader has left when it writes
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == SIGPIPE_EXIT and err == ""
