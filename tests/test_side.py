"""Side trials (`[[side]]`, search/study/side.py): configs run once beside the search, never proposed by a sampler;
checked in the study file, run by a real study on SQLite with real MLflow, and found by the pick's pool."""
from __future__ import annotations

import json
import re
from pathlib import Path

import optuna
import pytest
from mlflow import MlflowClient

from conftest import tiny_study_file
from latentsweep.search.cli.main import main
from latentsweep.search.pick.candidates import best_of_each_kind, top_trials
from latentsweep.search.study.report import study_table
from latentsweep.search.study.contract import SIDE_ATTR, read_side as side_values
from latentsweep.search.study.studyfile import load_study_file
from latentsweep.trainers.core.errors import ConfigError
from latentsweep.trainers.data.synthetic import write_synthetic

KIND = '"model.kind" = { type = "categorical", choices = ["mlp", "residual_mlp"] }\n'
SIDE = '\n[[side]]\nmodel = { kind = "knn" }\n'


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> Path:
    train, _, _ = write_synthetic(tmp_path_factory.mktemp("syn"), 240, dim_text=24, dim_image=32, n_test=100)
    return train


def test_side_entries_are_read_as_knob_values(tmp_path):
    sf = load_study_file(tiny_study_file(tmp_path, "s", extra=KIND + SIDE))
    assert sf.side == ({"model.kind": "knn"},)
    kind = next(p for p in sf.space if p.key == "model.kind")
    assert "knn" not in kind.choices  # the sampler's choices are the file's, without it


@pytest.mark.parametrize("side, message", [
    ('[[side]]\nmodel = { kinds = "knn" }\n', "unknown config key 'model.kinds' (did you mean 'model.kind'?)"),
    ('[[side]]\nmodel = { kind = "knn" }\nslots = { k = 2 }\n', "side[0]: an invalid config: slots.k = 2"),
    ('[[side]]\n', "side[0]: sets no knob"),
    ('[side]\nmodel = { kind = "knn" }\n', "side: expected [[side]] tables"),
])
def test_bad_side_entries_fail_the_file_in_one_line(tmp_path, side, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_study_file(tiny_study_file(tmp_path, "s", extra=KIND + "\n" + side))


def test_a_study_runs_its_side_trial_once_and_never_samples_it(tmp_path, synthetic):
    state = tmp_path / "state"
    sf = tiny_study_file(tmp_path, "side", n_trials=4, extra=KIND + SIDE)
    args = ["study", "run", str(sf), "--data", str(synthetic), "--state-dir", str(state), "--quiet"]
    assert main(args) == 0
    assert main([*args[:-1], "--n-trials", "6", "--quiet"]) == 0  # resumed: the side trial is not queued again
    study = optuna.load_study(study_name="side", storage=f"sqlite:///{state / 'optuna.db'}")
    trials = study.get_trials()
    side = [t for t in trials if SIDE_ATTR in t.user_attrs]
    assert len(trials) == 6 and len(side) == 1
    first = side[0]
    assert first.number == 0 and first.params == {} and first.state == optuna.trial.TrialState.COMPLETE
    assert side_values(first) == {"model.kind": "knn"}
    assert 'kind = "knn"' in (state / first.user_attrs["out_dir"] / "config.toml").read_text()
    assert all(t.params["model.kind"] in ("mlp", "residual_mlp") for t in trials[1:])
    run = MlflowClient(f"sqlite:///{state / 'mlflow.db'}").get_run(first.user_attrs["mlflow_run_id"])
    assert json.loads(run.data.tags[SIDE_ATTR]) == {"model.kind": "knn"}
    assert run.data.params["model.kind"] == "knn" and not any(k.startswith("search.") for k in run.data.params)
    table = study_table(study, varying_only=False)  # `study status`: its values stand in its row
    assert table.loc[table["number"] == 0, "model.kind"].item() == "knn"
    pool = best_of_each_kind(top_trials(study, len(trials)))
    assert 0 in [t.number for t in pool]  # the pick's pool has it as the best (only) knn trial
