"""Tests of search-space parsing (types, validation lines, conditions, ordering) and sampling from Optuna trials."""
from __future__ import annotations

import optuna
import pytest

from latentsweep.search.study.space import Param, active_values, flatten_space, parse_space, sample
from latentsweep.search.study.studyfile import load_study_file
from latentsweep.trainers.config.tree import Config, flatten
from latentsweep.trainers.core.errors import ConfigError

optuna.logging.set_verbosity(optuna.logging.WARNING)

BASE = flatten(Config())


def parse(table: dict, fixed: set[str] = frozenset()) -> tuple[list[Param], list[str]]:
    errors: list[str] = []
    params = parse_space(table, set(fixed), errors, "s.toml")
    return params, errors


def parse_ok(table: dict, fixed: set[str] = frozenset()) -> list[Param]:
    params, errors = parse(table, fixed)
    assert errors == []
    return params


class RecordingTrial(optuna.trial.FixedTrial):
    """A FixedTrial that remembers the order in which knobs were suggested."""

    def __init__(self, params: dict):
        super().__init__(params)
        self.order: list[str] = []

    def _suggest(self, name, distribution):
        self.order.append(name)
        return super()._suggest(name, distribution)


# ---------------------------------------------------------------------------------------------- parsing

def test_parse_each_type():
    params = parse_ok({
        "optim.lr": {"type": "float", "low": 1e-4, "high": 1e-2, "log": True},
        "model.dropout": {"type": "float", "low": 0.0, "high": 0.5, "step": 0.1},
        "train.epochs": {"type": "int", "low": 2, "high": 10, "step": 2},
        "model.n_anchors": {"type": "int", "low": 8, "high": 64, "log": True},
        "model.activation": {"type": "categorical", "choices": ["gelu", "relu"]},
        "model.hidden": {"choices": ["64", "64,32"]},  # type defaults to categorical when choices are given
    })
    by_key = {p.key: p for p in params}
    assert by_key["optim.lr"] == Param("optim.lr", "float", low=1e-4, high=1e-2, log=True)
    assert by_key["model.dropout"].step == 0.1 and not by_key["model.dropout"].log
    assert (by_key["train.epochs"].type, by_key["train.epochs"].step) == ("int", 2)
    assert by_key["model.n_anchors"].log
    assert by_key["model.activation"].choices == ("gelu", "relu")
    assert by_key["model.hidden"].type == "categorical"


def test_nested_tables_and_dotted_keys_are_the_same():
    dotted = {"loss.triplet.margin": {"type": "float", "low": 0.1, "high": 0.3}}
    nested = {"loss": {"triplet": {"margin": {"type": "float", "low": 0.1, "high": 0.3}}}}
    assert flatten_space(nested) == dotted
    assert parse_ok(nested) == parse_ok(dotted)


def test_contains():
    p = Param("optim.lr", "float", low=0.1, high=0.5)
    assert p.contains(0.1) and p.contains(0.5) and not p.contains(0.51)
    c = Param("model.activation", "categorical", choices=("gelu", "relu"))
    assert c.contains("relu") and not c.contains("tanh")


def test_suggest_types_and_bounds_with_a_real_study():
    params = parse_ok({
        "optim.lr": {"type": "float", "low": 1e-4, "high": 1e-2, "log": True},
        "train.epochs": {"type": "int", "low": 2, "high": 10, "step": 2},
        "model.hidden": {"type": "categorical", "choices": ["64", "64,32"]},
    })
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(20):
        trial = study.ask()
        chosen = sample(trial, params, BASE)
        assert 1e-4 <= chosen["optim.lr"] <= 1e-2
        assert chosen["train.epochs"] in (2, 4, 6, 8, 10)
        assert chosen["model.hidden"] in ((64,), (64, 32))  # coerced to the config's type
        assert set(trial.params) == set(chosen)
        study.tell(trial, 0.0)


# ---------------------------------------------------------------------------------------------- validation lines

ERROR_CASES = {
    "unknown knob": ({"optim.lrr": {"type": "float", "low": 0.1, "high": 0.2}}, "did you mean 'optim.lr'"),
    "inverted range": ({"optim.lr": {"type": "float", "low": 0.2, "high": 0.1}}, "inverted range"),
    "empty range": ({"optim.lr": {"type": "float", "low": 0.1, "high": 0.1}}, "empty range"),
    "log with zero low": ({"optim.lr": {"type": "float", "low": 0.0, "high": 0.1, "log": True}}, "log scale needs low > 0"),
    "log with negative low": ({"loss.slot_diversity.delta": {"type": "float", "low": -0.5, "high": 0.5,
                                                             "log": True}}, "log scale needs low > 0"),
    "step with log": ({"optim.lr": {"type": "float", "low": 0.1, "high": 0.5, "log": True, "step": 0.1}},
                      "'step' and 'log' cannot be combined"),
    "zero step": ({"optim.lr": {"type": "float", "low": 0.1, "high": 0.5, "step": 0}}, "step must be > 0"),
    "fractional int step": ({"train.epochs": {"type": "int", "low": 1, "high": 9, "step": 0.5}},
                            "int step must be a whole number"),
    "fractional int bounds": ({"geometry.ridge_lambda": {"type": "int", "low": 1, "high": 9.5}},
                              "int range needs whole"),
    "bound outside the config range": ({"model.dropout": {"type": "float", "low": 0.0, "high": 0.95}},
                                       "above the maximum 0.9"),
    "missing bounds": ({"optim.lr": {"type": "float", "low": 0.1}}, "needs numeric 'low' and 'high'"),
    "unknown type": ({"optim.lr": {"type": "flaot", "low": 0.1, "high": 0.2}}, "did you mean 'float'"),
    "unknown entry field": ({"optim.lr": {"type": "float", "low": 0.1, "hihg": 0.2, "high": 0.3}},
                            "unknown field 'hihg' (did you mean 'high'?)"),
    "not a table": ({"optim.lr": 0.1}, "expected a table"),
    "empty choices": ({"model.activation": {"type": "categorical", "choices": []}}, "non-empty list 'choices'"),
    "duplicate choices": ({"model.activation": {"choices": ["gelu", "gelu"]}}, "duplicates"),
    "invalid choice": ({"model.activation": {"choices": ["gelu", "swish"]}}, "'swish' is not one of"),
    "list choice": ({"model.hidden": {"choices": [[64, 32]]}}, "use a string such as"),
    "condition on an unset knob": ({"loss.triplet.margin": {"type": "float", "low": 0.1, "high": 0.3,
                                                            "when": "loss.triplet.weight > 0"}},
                                   "condition on 'loss.triplet.weight', which is neither searched nor fixed"),
    "condition on an unknown key": ({"loss.triplet.margin": {"type": "float", "low": 0.1, "high": 0.3,
                                                             "when": "loss.triplet.weigth > 0"}},
                                    "did you mean 'loss.triplet.weight'"),
    "malformed condition": ({"optim.lr": {"type": "float", "low": 0.1, "high": 0.2, "when": "lr is big"}},
                            "is not of the form 'KEY OP VALUE'"),
    "non-literal condition value": ({"optim.lr": {"type": "float", "low": 0.1, "high": 0.2,
                                                  "when": "model.kind == mlp"}}, "is not a literal"),
    "condition that is a number": ({"optim.lr": {"type": "float", "low": 0.1, "high": 0.2, "when": 3}},
                                   "is not of the form"),
    "condition value of the wrong type": ({"optim.lr": {"type": "float", "low": 0.1, "high": 0.2,
                                                        "when": "model.kind > 0"}}, "model.kind: expected str"),
    "condition value that is not a choice": ({"optim.lr": {"type": "float", "low": 0.1, "high": 0.2,
                                                           "when": "model.activation == 'gleu'"}},
                                             "did you mean 'gelu'"),
    "in without a list": ({"optim.lr": {"type": "float", "low": 0.1, "high": 0.2, "when": "model.kind in 'mlp'"}},
                          "'in' needs a list"),
}


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_each_problem_gives_one_line(case):
    table, fragment = ERROR_CASES[case]
    _, errors = parse(table, fixed={"model.kind", "model.activation"})
    assert len(errors) == 1, errors
    assert fragment in errors[0]
    assert errors[0].startswith("s.toml: space")
    assert "\n" not in errors[0]


def test_condition_on_a_fixed_knob_is_fine():
    table = {"loss.triplet.margin": {"type": "float", "low": 0.1, "high": 0.3, "when": "loss.triplet.weight > 0"}}
    assert len(parse_ok(table, fixed={"loss.triplet.weight"})) == 1


def test_cycle_is_reported():
    _, errors = parse({
        "loss.queue_infonce.size": {"type": "int", "low": 8, "high": 64, "when": "train.batch_size > 16"},
        "train.batch_size": {"type": "int", "low": 8, "high": 64, "when": "loss.queue_infonce.size > 16"},
    })
    assert len(errors) == 1
    assert "cycle among loss.queue_infonce.size, train.batch_size" in errors[0]


def test_condition_on_itself_is_reported():
    _, errors = parse({"optim.lr": {"type": "float", "low": 0.1, "high": 0.2, "when": "optim.lr > 0.15"}})
    assert any("condition on itself" in e for e in errors)


def test_study_file_lists_every_problem_in_one_error(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("""
[base.loss]
infonce = { weight = 1.0 }

[space]
"optim.lrr" = { type = "float", low = 1e-4, high = 1e-2 }
"model.dropout" = { type = "float", low = 0.5, high = 0.1 }
"temperature.tau" = { type = "float", low = 0.1, high = 0.1 }
"optim.weight_decay" = { type = "float", low = 0.0, high = 0.1, log = true }
"loss.triplet.margin" = { type = "float", low = 0.1, high = 0.3, log = true, step = 0.1 }
"loss.cosine.weight" = { type = "float", low = 0.0, high = 1.0, when = "loss.moment.weight > 0" }
"loss.mse.weight" = { type = "float", low = 0.0, high = 1.0, when = "weight is big" }
"loss.queue_infonce.size" = { type = "int", low = 8, high = 64, when = "train.batch_size > 16" }
"train.batch_size" = { type = "int", low = 8, high = 64, when = "loss.queue_infonce.size > 16" }
""")
    with pytest.raises(ConfigError) as info:
        load_study_file(path)
    header, *lines = str(info.value).splitlines()
    assert header == f"8 problem(s) in {path}:"
    assert len(lines) == 8
    for fragment in ("did you mean 'optim.lr'", "inverted range", "empty range", "log scale needs low > 0",
                     "cannot be combined", "neither searched nor fixed", "not of the form", "cycle"):
        assert sum(fragment in line for line in lines) == 1, fragment


# ---------------------------------------------------------------------------------------------- conditions

TRIPLET = {
    "loss.triplet.weight": {"type": "float", "low": 0.0, "high": 1.0},
    "loss.triplet.margin": {"type": "float", "low": 0.05, "high": 0.4, "when": "loss.triplet.weight > 0.1"},
}


def test_conditioned_knob_sampled_only_when_condition_holds_fixed_trial():
    params = parse_ok(TRIPLET)
    off = sample(optuna.trial.FixedTrial({"loss.triplet.weight": 0.05, "loss.triplet.margin": 0.3}), params, BASE)
    assert off == {"loss.triplet.weight": 0.05}
    on = sample(optuna.trial.FixedTrial({"loss.triplet.weight": 0.5, "loss.triplet.margin": 0.3}), params, BASE)
    assert on == {"loss.triplet.weight": 0.5, "loss.triplet.margin": 0.3}


def test_conditioned_knob_sampled_only_when_condition_holds_real_study():
    params = parse_ok(TRIPLET)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    seen = {True: 0, False: 0}
    for _ in range(40):
        trial = study.ask()
        chosen = sample(trial, params, BASE)
        active = chosen["loss.triplet.weight"] > 0.1
        assert ("loss.triplet.margin" in chosen) == active
        assert ("loss.triplet.margin" in trial.params) == active
        seen[active] += 1
        study.tell(trial, 0.0)
    assert seen[True] and seen[False]  # both branches exercised


@pytest.mark.parametrize("cond, kind, holds", [
    ("model.kind == 'mlp'", "mlp", True),
    ("model.kind != 'mlp'", "mlp", False),
    ("model.kind in ['linear', 'relative']", "relative", True),
    ("model.kind in ['linear', 'relative']", "mlp", False),
])
def test_condition_operators_on_a_fixed_knob(cond, kind, holds):
    params = parse_ok({"model.n_anchors": {"type": "int", "low": 8, "high": 64, "when": cond}}, fixed={"model.kind"})
    chosen = sample(optuna.trial.FixedTrial({"model.n_anchors": 16}), params, {**BASE, "model.kind": kind})
    assert ("model.n_anchors" in chosen) == holds


def test_condition_on_a_list_knob_compares_typed_values():
    # The sampled hidden sizes are tuples; the condition's '64' is read in the knob's type, so it can hold.
    params = parse_ok({
        "model.hidden": {"choices": ["64", "64,32"]},
        "model.dropout": {"type": "float", "low": 0.0, "high": 0.5, "when": "model.hidden == '64'"},
        "model.residual": {"choices": [True, False], "when": "model.hidden in ['64,32', '128']"},
    })
    chosen = sample(optuna.trial.FixedTrial({"model.hidden": "64", "model.dropout": 0.2, "model.residual": True}),
                    params, BASE)
    assert chosen == {"model.hidden": (64,), "model.dropout": 0.2}
    chosen = sample(optuna.trial.FixedTrial({"model.hidden": "64,32", "model.dropout": 0.2, "model.residual": True}),
                    params, BASE)
    assert chosen == {"model.hidden": (64, 32), "model.residual": True}


def test_all_conditions_of_a_list_must_hold():
    params = parse_ok({
        "loss.triplet.weight": {"type": "float", "low": 0.0, "high": 1.0},
        "loss.triplet.margin": {"type": "float", "low": 0.05, "high": 0.4,
                                "when": ["loss.triplet.weight > 0.1", "loss.triplet.weight <= 0.5"]},
    })
    for weight, active in ((0.05, False), (0.3, True), (0.9, False)):
        chosen = sample(optuna.trial.FixedTrial({"loss.triplet.weight": weight, "loss.triplet.margin": 0.2}),
                        params, BASE)
        assert ("loss.triplet.margin" in chosen) == active, weight


def test_sampling_order_respects_dependencies():
    # Written in reverse: c depends on b, b depends on a.
    params = parse_ok({
        "loss.triplet.margin": {"type": "float", "low": 0.1, "high": 0.3, "when": "loss.triplet.weight > 0.1"},
        "loss.triplet.weight": {"type": "float", "low": 0.0, "high": 1.0, "when": "optim.lr > 0.001"},
        "optim.lr": {"type": "float", "low": 1e-4, "high": 1e-2, "log": True},
    })
    keys = [p.key for p in params]
    assert keys.index("optim.lr") < keys.index("loss.triplet.weight") < keys.index("loss.triplet.margin")
    trial = RecordingTrial({"optim.lr": 0.005, "loss.triplet.weight": 0.5, "loss.triplet.margin": 0.2})
    chosen = sample(trial, params, BASE)
    assert trial.order == ["optim.lr", "loss.triplet.weight", "loss.triplet.margin"]
    assert list(chosen) == trial.order
    # A false condition upstream switches off the whole chain (the inactive knob keeps its base value 0.0).
    trial = RecordingTrial({"optim.lr": 0.0005, "loss.triplet.weight": 0.5, "loss.triplet.margin": 0.2})
    assert sample(trial, params, BASE) == {"optim.lr": 0.0005}
    assert trial.order == ["optim.lr"]


def test_active_values_drops_inactive_recipe_knobs():
    params = parse_ok(TRIPLET)
    values = {"loss.triplet.weight": 0.0, "loss.triplet.margin": 0.2}
    assert active_values(params, BASE, values) == {"loss.triplet.weight": 0.0}
    values = {"loss.triplet.weight": 0.5, "loss.triplet.margin": 0.2}
    assert active_values(params, BASE, values) == values
