"""Tests of valid-only spaces: per-branch entries (`KEY#label`) and the study-file check that probes every branch."""
from __future__ import annotations

from pathlib import Path

import optuna
import pytest

from conftest import tiny_study_file
from latentsweep.search.study.branches import probe_values
from latentsweep.search.cli.main import main
from latentsweep.search.study.space import parse_space, sample
from latentsweep.search.study.studyfile import load_study_file
from latentsweep.trainers.config.tree import Config, flatten
from latentsweep.trainers.core.errors import ConfigError
from latentsweep.trainers.data.synthetic import write_synthetic

BASE = flatten(Config())

# deep_mlp needs >= 2 hidden layers; a one-layer choice under it is an invalid branch.
BAD_HIDDEN = """
"model.kind" = { type = "categorical", choices = ["mlp", "deep_mlp"] }
"model.hidden" = { type = "categorical", choices = ["32", "32,32"] }
"""
GOOD_HIDDEN = """
"model.kind" = { type = "categorical", choices = ["mlp", "deep_mlp"] }
"model.hidden" = { type = "categorical", choices = ["32", "64"], when = "model.kind == 'mlp'" }
"model.hidden#deep" = { type = "categorical", choices = ["32,32", "64,32,32"], when = "model.kind == 'deep_mlp'" }
"""
# slots.k = 1 with a diversity weight > 0: invalid only on one side of a numeric threshold of another knob.
BAD_SLOTS = """
"slots.k" = { type = "int", low = 0, high = 3 }
"loss.slot_diversity.weight" = { type = "float", low = 0.0, high = 0.5, when = "slots.k > 0" }
"""


def problems(path: Path) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_study_file(path)
    return str(info.value).splitlines()[1:]


def test_invalid_branch_is_rejected_naming_the_values(tmp_path):
    lines = problems(tiny_study_file(tmp_path, "bad", extra=BAD_HIDDEN))
    assert len(lines) == 1
    assert "model.kind='deep_mlp'" in lines[0] and "model.hidden='32'" in lines[0]
    assert "deep_mlp needs at least 2 hidden layers" in lines[0]


def test_every_invalid_branch_is_listed_at_once(tmp_path):
    lines = problems(tiny_study_file(tmp_path, "bad", extra=BAD_HIDDEN + BAD_SLOTS))
    assert len(lines) == 2
    assert any("deep_mlp needs" in line for line in lines)
    assert any("slots.k=1" in line and "needs slots.k >= 2" in line for line in lines)


def test_per_branch_entries_pass_and_shipped_studies_pass(tmp_path):
    study = load_study_file(tiny_study_file(tmp_path, "good", extra=GOOD_HIDDEN))
    assert {p.name for p in study.space} >= {"model.hidden", "model.hidden#deep"}
    for path in sorted((Path(__file__).resolve().parents[1] / "studies").glob("*.toml")):
        load_study_file(path)


def test_overlapping_branches_are_reported(tmp_path):
    overlapping = GOOD_HIDDEN.replace("when = \"model.kind == 'mlp'\"", "when = \"model.kind != 'linear'\"")
    lines = problems(tiny_study_file(tmp_path, "overlap", extra=overlapping))
    assert any("model.hidden and model.hidden#deep are both active" in line for line in lines), lines


def test_branch_without_a_condition_is_reported(tmp_path):
    text = '"model.hidden#deep" = { type = "categorical", choices = ["32,32"] }'
    assert any("a branch entry needs a 'when' condition" in line
               for line in problems(tiny_study_file(tmp_path, "nowhen", extra=text)))


def test_branch_entries_sample_only_valid_hidden_per_kind_with_a_real_study():
    errors: list[str] = []
    import tomllib

    space = parse_space(tomllib.loads("[space]\n" + GOOD_HIDDEN)["space"], set(), errors, "t")
    assert errors == []
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    kinds = set()
    for _ in range(30):
        trial = study.ask()
        chosen = sample(trial, space, BASE)
        kinds.add(chosen["model.kind"])
        layers = len(chosen["model.hidden"])
        assert layers >= 2 if chosen["model.kind"] == "deep_mlp" else layers == 1
        # one Optuna parameter per branch: a categorical's choices never change under one name
        assert ("model.hidden#deep" in trial.params) == (chosen["model.kind"] == "deep_mlp")
        study.tell(trial, 0.0)
    assert kinds == {"mlp", "deep_mlp"}


def test_enqueued_recipe_goes_to_its_branch(tmp_path):
    text = tiny_study_file(tmp_path, "q", extra=GOOD_HIDDEN).read_text()
    path = tmp_path / "q.toml"
    path.write_text(text + '\n[[enqueue]]\nmodel = { kind = "deep_mlp", hidden = [64, 32, 32] }\n')
    study = load_study_file(path)
    assert study.enqueue[0] == {"model.kind": "deep_mlp", "model.hidden#deep": "64,32,32"}
    path.write_text(text + '\n[[enqueue]]\nmodel = { kind = "deep_mlp", hidden = [64] }\n')
    assert any("model.hidden='64' lies outside the searched space (model.hidden#deep)" in line
               for line in problems(path))


def test_probe_values_cover_both_sides_of_a_threshold():
    errors: list[str] = []
    space = parse_space({"slots.k": {"type": "int", "low": 0, "high": 8},
                         "loss.slot_diversity.weight": {"type": "float", "low": 0.0, "high": 0.5,
                                                        "when": "slots.k > 1"},
                         "loss.slot_diversity.delta": {"type": "float", "low": 0.0, "high": 0.9,
                                                       "when": "loss.slot_diversity.weight > 0.02"}},
                        set(), errors, "t")
    by_name = {p.name: p for p in space}
    assert {0, 1, 2, 8} <= set(probe_values(by_name["slots.k"], space))
    weights = probe_values(by_name["loss.slot_diversity.weight"], space)
    assert min(weights) == 0.0 and any(w > 0.02 for w in weights) and 0.02 in weights


def test_study_run_rejects_an_invalid_branch_before_any_trial(tmp_path, capsys):
    train, _, _ = write_synthetic(tmp_path / "syn", 60, dim_text=8, dim_image=8, n_test=10)
    path = tiny_study_file(tmp_path, "badrun", extra=BAD_HIDDEN)
    state = tmp_path / "state"
    assert main(["study", "run", str(path), "--data", str(train), "--state-dir", str(state), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("latentsweep: error:") and "deep_mlp needs at least 2 hidden layers" in err
    assert not (state / "optuna.db").exists()
