"""Studies end to end on real SQLite Optuna storage and real MLflow (SQLite backend), read back by the real clients."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from mlflow import MlflowClient

from conftest import default_sigint
from conftest import tiny_study_file as study_file
from latentsweep.search.cli.main import main
from latentsweep.trainers.data.synthetic import write_synthetic



@pytest.fixture(scope="module")
def state(tmp_path_factory) -> Path:
    """One state directory for the module: MLflow's SQLite migrations run once (each test uses its own study name)."""
    return tmp_path_factory.mktemp("state")


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> Path:
    train, _, _ = write_synthetic(tmp_path_factory.mktemp("syn"), 240, dim_text=24, dim_image=32, n_test=100)
    return train


def run(args: list[str]) -> int:
    return main(["study", "run", *args, "--quiet"])


def client(state: Path) -> MlflowClient:
    return MlflowClient(f"sqlite:///{state / 'mlflow.db'}")


def optuna_study(state: Path, name: str) -> optuna.Study:
    return optuna.load_study(study_name=name, storage=f"sqlite:///{state / 'optuna.db'}")


def child_runs(state: Path, name: str):
    c = client(state)
    exp = c.get_experiment_by_name(name)
    runs = c.search_runs([exp.experiment_id], filter_string="tags.`latentsweep.role` = 'trial'")
    return c, exp, runs


def test_study_runs_and_tracks_every_trial(tmp_path, state, synthetic, capsys):
    sf = study_file(tmp_path, "tracked", n_trials=3, epochs=3)
    sf.write_text(sf.read_text().replace("[study]\n", '[study]\ndescription = "a tiny study"\n', 1))
    assert run([str(sf), "--data", str(synthetic), "--state-dir", str(state)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    study = optuna_study(state, "tracked")
    trials = study.get_trials()
    assert [t.state for t in trials] == [optuna.trial.TrialState.COMPLETE] * 3
    assert summary["best_value"] == pytest.approx(study.best_value)

    c, exp, runs = child_runs(state, "tracked")
    assert sorted(r.info.run_name for r in runs) == ["trial-0", "trial-1", "trial-2"]
    parents = c.search_runs([exp.experiment_id], filter_string="tags.`latentsweep.role` = 'parent'")
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    for r in runs:
        number = int(r.data.tags["optuna.trial_number"])
        trial = trials[number]
        assert r.info.status == "FINISHED"
        assert r.data.tags["mlflow.parentRunId"] == parents[0].info.run_id
        assert r.data.tags["data_fingerprint"] and r.data.tags["seed"] == "0"
        assert len(r.data.tags["mlflow.source.git.commit"]) == 40  # MLflow's Source column
        assert r.data.params["optim.lr"] == str(trial.params["optim.lr"])
        # searched knobs: listed in a tag and logged apart from the resolved config as search.<knob>
        assert set(r.data.tags["latentsweep.searched"].split(",")) >= set(trial.params)
        assert {k[len("search."):] for k in r.data.params if k.startswith("search.")} == set(trial.params)
        # the objective Optuna records (best epoch), not the last epoch's val/mrr, and the best epoch
        assert r.data.metrics["best/val/mrr"] == pytest.approx(trial.value)
        best_so_far = [m.value for m in c.get_metric_history(r.info.run_id, "best/val/mrr")]
        assert len(best_so_far) == 3 and best_so_far == sorted(best_so_far)  # one point per epoch, never down
        assert r.data.metrics["best_epoch"] == trial.user_attrs["best_epoch"]
        assert "val/mrr" in r.data.tags["mlflow.note.content"]
        (dataset,) = r.inputs.dataset_inputs
        assert dataset.dataset.digest == r.data.tags["data_fingerprint"] and dataset.dataset.name == synthetic.name
        assert {t.key: t.value for t in dataset.tags}["mlflow.data.context"] == "train"
        assert r.data.params["train.epochs"] == "3"
        history = c.get_metric_history(r.info.run_id, "val/mrr")
        assert [m.step for m in history] == [0, 1, 2]
        # the values MLflow shows are the ones the pruner saw
        assert [m.value for m in history] == pytest.approx([trial.intermediate_values[s] for s in (0, 1, 2)])
        assert trial.value == pytest.approx(max(m.value for m in history))
        names = {a.path for a in c.list_artifacts(r.info.run_id)}
        assert {"best.pt", "config.toml", "metrics.csv", "rank_distribution.png"} <= names
    parent_artifacts = {a.path for a in c.list_artifacts(parents[0].info.run_id, "plots")}
    assert "plots/optimization_history.png" in parent_artifacts
    # MLflow 3 shows a classic ML experiment (not a GenAI app); the study file's description is shown
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    assert exp.tags["mlflow.experiment.primaryMetric.name"] == "best/val/mrr"
    assert parents[0].data.tags["mlflow.note.content"] == "a tiny study"
    assert study.metric_names == ["val/mrr"]  # optuna-dashboard's label instead of "Objective 0"


def test_conditional_knob_only_sampled_when_condition_holds(tmp_path, state, synthetic):
    sf = study_file(tmp_path, "cond", n_trials=4)
    assert run([str(sf), "--data", str(synthetic), "--state-dir", str(state)]) == 0
    for t in optuna_study(state, "cond").get_trials():
        assert ("loss.triplet.margin" in t.params) == (t.params["loss.triplet.weight"] > 0.5)


def test_resume_and_budget_is_total_not_per_run(tmp_path, state, synthetic):
    sf = study_file(tmp_path, "resume", n_trials=2)
    args = [str(sf), "--data", str(synthetic), "--state-dir", str(state)]
    assert run(args) == 0
    assert run(args) == 0  # same command again: the budget is already spent, nothing new runs
    assert len(optuna_study(state, "resume").get_trials()) == 2
    assert run(args + ["--n-trials", "3"]) == 0
    assert len(optuna_study(state, "resume").get_trials()) == 3


def test_parallel_sqlite_workers_spend_exact_budget(tmp_path, state, synthetic, capsys):
    sf = study_file(tmp_path, "parallel", n_trials=5)
    assert run([str(sf), "--data", str(synthetic), "--state-dir", str(state), "--workers", "2"]) == 0
    assert "database is locked" not in capsys.readouterr().err
    trials = optuna_study(state, "parallel").get_trials()
    assert len(trials) == 5 and all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    _, _, runs = child_runs(state, "parallel")
    assert sorted(int(r.data.tags["optuna.trial_number"]) for r in runs) == [0, 1, 2, 3, 4]
    assert all(r.info.status == "FINISHED" for r in runs)


def test_pruned_trial_is_told_apart_from_failures_in_mlflow(tmp_path, state, synthetic):
    extra = '\n[[enqueue]]\n"optim.lr" = 0.01\n"loss.triplet.weight" = 0.0\n' \
            '\n[[enqueue]]\n"optim.lr" = 0.0001\n"loss.triplet.weight" = 0.0\n'
    sf = study_file(tmp_path, "pruned", n_trials=2, epochs=3, pruner="median", extra=extra)
    text = sf.read_text().replace('pruner = { name = "median" }',
                                  'pruner = { name = "median", n_startup_trials = 1, n_warmup_steps = 0 }')
    sf.write_text(text)
    assert run([str(sf), "--data", str(synthetic), "--state-dir", str(state)]) == 0
    trials = optuna_study(state, "pruned").get_trials()
    assert trials[1].state == optuna.trial.TrialState.PRUNED
    _, _, runs = child_runs(state, "pruned")
    status = {r.info.run_name: (r.info.status, r.data.tags["optuna.state"]) for r in runs}
    # a pruned trial ended as designed: no red FAILED/KILLED mark (as Optuna's MLflowCallback), its state in a tag
    assert status == {"trial-0": ("FINISHED", "COMPLETE"), "trial-1": ("FINISHED", "PRUNED")}
    pruned = next(r for r in runs if r.info.run_name == "trial-1")
    assert "Pruned" in pruned.data.tags["mlflow.note.content"]
    assert pruned.data.metrics["best/val/mrr"] == pytest.approx(max(trials[1].intermediate_values.values()))


def test_failing_config_fails_trial_and_run_but_not_study(tmp_path, state, synthetic):
    # relative model with more anchors than training captions cannot be built: a config error inside the trial
    extra = '"model.kind" = { type = "categorical", choices = ["relative"] }\n' \
            '"model.n_anchors" = { type = "int", low = 100000, high = 200000 }\n'
    sf = study_file(tmp_path, "failing", n_trials=1, extra=extra)
    assert run([str(sf), "--data", str(synthetic), "--state-dir", str(state)]) == 0
    (trial,) = optuna_study(state, "failing").get_trials()
    assert trial.state == optuna.trial.TrialState.FAIL
    assert "anchor" in trial.user_attrs["latentsweep.error"]
    _, _, runs = child_runs(state, "failing")
    assert [r.info.status for r in runs] == ["FAILED"]


def test_real_clients_read_what_we_write(tmp_path, state, synthetic):
    sf = study_file(tmp_path, "clients", n_trials=1)
    assert run([str(sf), "--data", str(synthetic), "--state-dir", str(state)]) == 0
    storage = f"sqlite:///{state / 'optuna.db'}"
    out = subprocess.run([str(Path(sys.executable).with_name("optuna")), "trials", "--study-name", "clients", "--storage", storage,
                          "-f", "json"], capture_output=True, text=True, check=True)
    rows = json.loads(out.stdout)
    assert len(rows) == 1 and rows[0]["state"] == "COMPLETE"
    exp = client(state).get_experiment_by_name("clients")
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{state / 'mlflow.db'}"}
    out = subprocess.run([str(Path(sys.executable).with_name("mlflow")), "runs", "list", "--experiment-id", exp.experiment_id],
                         capture_output=True, text=True, env=env, check=True)
    assert "trial-0" in out.stdout and "study-clients" in out.stdout


def test_status_table_lists_trials_and_varying_knobs(tmp_path, state, synthetic, capsys):
    sf = study_file(tmp_path, "table", n_trials=2)
    assert run([str(sf), "--data", str(synthetic), "--state-dir", str(state)]) == 0
    capsys.readouterr()
    assert main(["study", "status", "table", "--state-dir", str(state), "--csv"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("number,state,value,duration_s,") and "optim.lr" in lines[0]
    assert len(lines) == 3
    assert main(["study", "status", "nosuch", "--state-dir", str(state)]) == 2
    assert "no study named 'nosuch'" in capsys.readouterr().err


@pytest.mark.slow
def test_ctrl_c_fails_trial_kills_run_and_resume_retries_it(tmp_path, state, synthetic):
    sf = study_file(tmp_path, "interrupt", n_trials=2, epochs=400)
    cmd = [sys.executable, "-m", "latentsweep", "study", "run", str(sf), "--data", str(synthetic),
           "--state-dir", str(state), "--quiet"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint)
    # Wait until the first trial's MLflow run has logged an epoch (seconds on a quiet machine; minutes when the
    # machine is loaded: a SIGINT before the study exists tests nothing, as a loaded run once showed).
    metrics_csv = state / "studies" / "interrupt" / "trial-0" / "metrics.csv"
    deadline = time.time() + 600
    while time.time() < deadline and not metrics_csv.exists() and proc.poll() is None:
        time.sleep(1)
    assert metrics_csv.exists(), "the first trial never logged an epoch"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    trials = optuna_study(state, "interrupt").get_trials()
    assert trials[0].state == optuna.trial.TrialState.FAIL
    assert trials[1].state == optuna.trial.TrialState.WAITING  # the retry, run first on resume
    _, _, runs = child_runs(state, "interrupt")
    assert [r.info.status for r in runs] == ["KILLED"], err
    text = sf.read_text().replace("epochs = 400", "epochs = 2")
    sf.write_text(text)
    assert run([str(sf), "--data", str(synthetic), "--state-dir", str(state)]) == 0
    trials = optuna_study(state, "interrupt").get_trials()
    assert [t.state.name for t in trials] == ["FAIL", "COMPLETE", "COMPLETE"]
    _, _, runs = child_runs(state, "interrupt")
    retried = [r for r in runs if r.data.tags.get("optuna.trial_number") == "1"]
    assert retried[0].data.tags["latentsweep.retry_of"] == "0"
    assert all(r.info.status != "RUNNING" for r in runs)


def test_status_of_a_study_with_only_waiting_trials(tmp_path, state, synthetic, capsys):
    extra = '\n[[enqueue]]\n"optim.lr" = 0.01\n"loss.triplet.weight" = 0.0\n'
    sf = study_file(tmp_path, "waiting", n_trials=2, extra=extra)
    assert main(["study", "create", str(sf), "--data", str(synthetic), "--state-dir", str(state), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["study", "status", "waiting", "--state-dir", str(state), "--csv"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("number,state,value,duration_s")
    assert lines[1:] == ["0,WAITING,,"]  # no value, no duration yet; one trial: no knob varies
