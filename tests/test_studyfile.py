"""Tests of study files: every shipped study loads and validates, and each kind of mistake is one ConfigError line."""
from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from latentsweep.search.study.studyfile import load_study_file
from latentsweep.trainers.config.tree import flatten, with_values
from latentsweep.trainers.core.errors import ConfigError
from latentsweep.trainers.config.validate import validate

STUDIES = sorted((Path(__file__).resolve().parents[1] / "studies").glob("*.toml"))

# A minimal valid file; tests append to it.
HEAD = """
[base.loss]
infonce = { weight = 1.0 }

[base.model]
hidden = [64]

[space]
"optim.lr" = { type = "float", low = 1e-4, high = 1e-2, log = true }
"loss.triplet.weight" = { type = "float", low = 0.0, high = 1.0 }
"loss.triplet.margin" = { type = "float", low = 0.05, high = 0.4, when = "loss.triplet.weight > 0.1" }
"model.hidden" = { type = "categorical", choices = ["64", "64,32"] }
"""


def write(tmp_path: Path, text: str, name: str = "s.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def problems(path: Path) -> list[str]:
    """The problem lines of the ConfigError raised by load_study_file (header checked against their count)."""
    with pytest.raises(ConfigError) as info:
        load_study_file(path)
    header, *lines = str(info.value).splitlines()
    assert header == f"{len(lines)} problem(s) in {path}:"
    return [line.strip() for line in lines]


# ---------------------------------------------------------------------------------------------- shipped studies

def test_studies_exist():
    assert {p.stem for p in STUDIES} >= {"quickstart", "baseline_mse", "bigjump", "moco", "vsepp_slots",
                                         "multilabel_triplet"}


@pytest.mark.parametrize("path", STUDIES, ids=[p.stem for p in STUDIES])
def test_shipped_study_loads_and_validates(path):
    study = load_study_file(path)
    validate(study.base)
    assert study.space, "a study without a space searches nothing"
    assert study.n_trials >= 1 and study.direction in ("maximize", "minimize")
    assert study.objective.startswith("val/")


@pytest.mark.parametrize("path", STUDIES, ids=[p.stem for p in STUDIES])
def test_shipped_study_enqueue_lies_inside_its_space(path):
    study = load_study_file(path)
    searched = {p.name: p for p in study.space}  # entries are keyed by Optuna name (KEY or KEY#branch)
    assert study.enqueue, f"{path.name} enqueues no known-good recipe"
    for entry in study.enqueue:
        assert set(entry) <= set(searched)
        for name, value in entry.items():
            assert searched[name].contains(value), (name, value)
        # The enqueued recipe applied to the base is itself a trainable config.
        validate(with_values(study.base, {searched[name].key: value for name, value in entry.items()}))


SELF_RECIPES = [p for p in STUDIES if {"recipe": p.name} in tomllib.loads(p.read_text()).get("enqueue", [])]


def test_some_studies_enqueue_their_own_base():
    assert len(SELF_RECIPES) >= 5


@pytest.mark.parametrize("path", SELF_RECIPES, ids=[p.stem for p in SELF_RECIPES])
def test_shipped_self_recipe_reproduces_the_base(path):
    study = load_study_file(path)
    base = flatten(study.base)
    keys = {p.name: p.key for p in study.space}
    for entry in study.enqueue[:1]:
        for name, value in entry.items():
            expected = base[keys[name]]
            shown = ",".join(map(str, expected)) if isinstance(expected, tuple) else expected
            assert value == shown, name


# ---------------------------------------------------------------------------------------------- defaults

def test_minimal_file_defaults(tmp_path):
    study = load_study_file(write(tmp_path, HEAD, "mystudy.toml"))
    assert study.name == "mystudy"
    assert (study.direction, study.objective, study.n_trials, study.timeout) == ("maximize", "val/mrr", 20, None)
    assert study.sampler == {"name": "tpe"} and study.pruner == {"name": "median"}
    assert study.fixed == {"loss.infonce.weight", "model.hidden"}
    assert study.base.loss.infonce.weight == 1.0


def test_study_settings_are_read(tmp_path):
    study = load_study_file(write(tmp_path, """
[study]
name = "x"
n_trials = 3
timeout = 60
direction = "minimize"
sampler = { name = "random", seed = 1 }
pruner = "none"
""" + HEAD))
    assert (study.name, study.n_trials, study.timeout, study.direction) == ("x", 3, 60, "minimize")
    assert study.sampler == {"name": "random", "seed": 1} and study.pruner == {"name": "none"}


# ---------------------------------------------------------------------------------------------- [study] errors

@pytest.mark.parametrize("study_text, fragment", [
    ("n_trail = 5", "study.n_trail: unknown setting (did you mean 'n_trials'?)"),
    ('sampler = "tpee"', "unknown sampler 'tpee' (did you mean 'tpe'?)"),
    ('sampler = { name = "randm" }', "unknown sampler 'randm' (did you mean 'random'?)"),
    ('pruner = "medain"', "unknown pruner 'medain' (did you mean 'median'?)"),
    ('pruner = { name = "median", n_startup_trial = 5 }',
     "study.pruner.n_startup_trial: not a setting of pruner 'median' (did you mean 'n_startup_trials'?)"),
    ('sampler = { name = "tpe", n_startup_trial = 5 }', "did you mean 'n_startup_trials'"),
    ('sampler = { name = "tpe", seed = [1] }', "study.sampler.seed: expected a number"),
    ("sampler = 3", "study.sampler: expected a name or a table"),
    ("n_trials = 0", "study.n_trials: must be a whole number >= 1, got 0"),
    ("n_trials = -2", "study.n_trials"),
    ("n_trials = 2.5", "study.n_trials"),
    ('n_trials = "ten"', "study.n_trials"),
    ("n_trials = true", "study.n_trials"),
    ("timeout = -1", "study.timeout"),
    ("timeout = true", "study.timeout"),
    ('direction = "maximise"', "did you mean 'maximize'"),
])
def test_study_setting_errors(tmp_path, study_text, fragment):
    lines = problems(write(tmp_path, f"[study]\n{study_text}\n" + HEAD))
    assert len(lines) == 1, lines
    assert fragment in lines[0]


def test_malformed_toml(tmp_path):
    path = write(tmp_path, "[study\nname = 1\n")
    with pytest.raises(ConfigError, match=f"{path}: malformed TOML"):
        load_study_file(path)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        load_study_file(tmp_path / "nope.toml")


def test_unknown_table_and_base_key(tmp_path):
    lines = problems(write(tmp_path, HEAD + '\n[spaces]\nx = 1\n\n[base.optim]\nlrr = 0.1\n'))
    assert len(lines) == 2
    assert any("unknown table [spaces] (did you mean 'space'?)" in line for line in lines)
    assert any("base: unknown config key 'optim.lrr' (did you mean 'optim.lr'?)" in line for line in lines)


def test_enqueue_written_as_one_table_is_one_error_line(tmp_path):
    """`[enqueue]` instead of `[[enqueue]]` (a table, not an array of them) crashed with a ValueError before."""
    lines = problems(write(tmp_path, HEAD + '\n[enqueue]\nrecipe = "x.toml"\n'))
    assert any("enqueue: expected [[enqueue]] tables, got dict" in line for line in lines)


def test_several_sections_report_together(tmp_path):
    lines = problems(write(tmp_path, '[study]\nn_trials = 0\nsampler = "tpee"\n' + HEAD
                           + '"optim.beta1" = { type = "float", low = 0.9, high = 0.5 }\n'
                           + '\n[[enqueue]]\n"optim.wd" = 0.1\n'))
    assert len(lines) == 4, lines


# ---------------------------------------------------------------------------------------------- [[enqueue]]

def test_enqueue_explicit_values(tmp_path):
    study = load_study_file(write(tmp_path, HEAD + """
[[enqueue]]
"optim.lr" = 0.001
"loss.triplet.weight" = 0.5
"loss.triplet.margin" = 0.3
"model.hidden" = "64,32"

[[enqueue]]
optim = { lr = 0.002 }
loss = { triplet = { weight = 0.0, margin = 0.2 } }
"""))
    first, second = study.enqueue
    assert first == {"optim.lr": 0.001, "loss.triplet.weight": 0.5, "loss.triplet.margin": 0.3,
                     "model.hidden": "64,32"}
    # The margin's condition (weight > 0.1) is false: it is not enqueued, exactly as the sampler would skip it.
    assert second == {"optim.lr": 0.002, "loss.triplet.weight": 0.0}


def test_enqueue_of_an_inactive_knob_with_a_non_base_value(tmp_path):
    lines = problems(write(tmp_path, HEAD + '\n[[enqueue]]\n"loss.triplet.weight" = 0.0\n'
                                            '"loss.triplet.margin" = 0.3\n'))
    assert len(lines) == 1
    assert "loss.triplet.margin=0.3 would be ignored" in lines[0]


def test_enqueue_of_a_knob_not_searched(tmp_path):
    lines = problems(write(tmp_path, HEAD + '\n[[enqueue]]\n"optim.weight_decay" = 0.1\n"optim.lrr" = 0.001\n'))
    assert len(lines) == 2
    assert "enqueue[0]: 'optim.weight_decay' is not a searched knob" in lines[0]
    assert "'optim.lrr' is not a searched knob (did you mean 'optim.lr'?)" in lines[1]


def test_enqueue_outside_the_space(tmp_path):
    lines = problems(write(tmp_path, HEAD + '\n[[enqueue]]\n"optim.lr" = 0.5\n"model.hidden" = "128"\n'))
    assert len(lines) == 2
    assert any("optim.lr=0.5 lies outside the searched space" in line for line in lines)
    assert any("model.hidden='128' lies outside" in line for line in lines)


def test_enqueue_value_of_the_wrong_type_is_a_line_not_a_crash(tmp_path):
    lines = problems(write(tmp_path, HEAD + '\n[[enqueue]]\n"optim.lr" = "fast"\n"loss.triplet.weight" = "x"\n'))
    assert len(lines) == 2
    assert "optim.lr: expected float, got 'fast'" in lines[0]


def test_recipe_from_another_file_takes_searched_values(tmp_path):
    write(tmp_path, "[base.loss]\ninfonce = { weight = 1.0 }\ntriplet = { weight = 0.5, margin = 0.3 }\n"
                    "[base.optim]\nlr = 0.002\n[base.model]\nhidden = [64, 32]\n[base.data]\npath = 'x.npz'\n",
          "other.toml")
    study = load_study_file(write(tmp_path, HEAD + '\n[[enqueue]]\nrecipe = "other.toml"\n'))
    assert study.enqueue == ({"optim.lr": 0.002, "loss.triplet.weight": 0.5, "loss.triplet.margin": 0.3,
                              "model.hidden": "64,32"},)


def test_recipe_with_a_different_fixed_knob_not_searched(tmp_path):
    write(tmp_path, "[base.loss]\ninfonce = { weight = 1.0 }\n[base.train]\nbatch_size = 64\n"
                    "[base.model]\nhidden = [64]\n", "other.toml")
    lines = problems(write(tmp_path, HEAD + '\n[[enqueue]]\nrecipe = "other.toml"\n'))
    assert len(lines) == 1
    assert "enqueue[0]: recipe other.toml sets train.batch_size=64 (base has 256) but train.batch_size " \
           "is not searched" in lines[0]


def test_recipe_missing_or_broken(tmp_path):
    lines = problems(write(tmp_path, HEAD + '\n[[enqueue]]\nrecipe = "gone.toml"\n'))
    assert len(lines) == 1 and "recipe gone.toml" in lines[0] and "file not found" in lines[0]
    write(tmp_path, "[base.optim]\nlrr = 0.1\n", "broken.toml")
    lines = problems(write(tmp_path, HEAD + '\n[[enqueue]]\nrecipe = "broken.toml"\n'))
    assert len(lines) == 1 and "recipe broken.toml" in lines[0] and "did you mean 'optim.lr'" in lines[0]


def test_recipes_naming_each_other_do_not_recurse(tmp_path):
    write(tmp_path, HEAD + '\n[[enqueue]]\nrecipe = "b.toml"\n', "a.toml")
    write(tmp_path, HEAD + '[base.optim]\nlr = 0.003\n\n[[enqueue]]\nrecipe = "a.toml"\n', "b.toml")
    assert load_study_file(tmp_path / "a.toml").enqueue == ({"optim.lr": 0.003, "loss.triplet.weight": 0.0,
                                                            "model.hidden": "64"},)
