"""Tests of the config tree: TOML round trip, value coercion, range/choice checks, closest-key errors, immutability."""
from __future__ import annotations

import dataclasses
import math
import tomllib

import pytest

from latentsweep.trainers.config.tree import (Config, check_key, coerce, dump_toml, flatten, from_dict, load_toml, parse_overrides,
                             to_dict, upgrade_tree, valid_keys, with_values)
from latentsweep.trainers.core.errors import ConfigError


def non_default() -> Config:
    """A config where every section differs from the defaults (including a tuple, bools and awkward strings)."""
    return with_values(Config(), {
        "data.path": 'C:\\data\\"quoted" train.npz', "data.salt": "tab\there\nnewline", "data.task": "multilabel",
        "model.hidden": (1024, 512, 7), "model.residual": True, "model.out_norm": False, "model.dropout": 0.25,
        "geometry.whiten_eps": 1e-7, "slots.k": 3, "loss.triplet.weight": 0.5, "loss.triplet.max_violation": False,
        "loss.infonce.label_smoothing": 0.1, "temperature.mode": "curriculum", "loss.queue_infonce.size": 123,
        "optim.lr": 3.3e-4, "schedule.name": "step", "train.epochs": 7, "eval.gallery_size": 50,
        "loss.triplet.direction": "c2i", "loss.queue_infonce.slice_mode": "stepwise",
        "loss.queue_infonce.in_batch": False,
        "train.monitor": "val/loss", "model.bias": False, "loss.multilabel_triplet.positives": "fixed",
    })


# ---------------------------------------------------------------------------------------------- round trip

@pytest.mark.parametrize("cfg", [Config(), non_default()], ids=["defaults", "non_default"])
def test_dump_toml_round_trips(cfg):
    text = dump_toml(cfg)
    back = from_dict(tomllib.loads(text))
    assert back == cfg
    assert flatten(back) == flatten(cfg)


def test_dump_toml_has_one_table_per_section():
    tree = tomllib.loads(dump_toml(non_default()))
    assert tree["model"]["hidden"] == [1024, 512, 7]
    assert tree["loss"]["triplet"] == {"weight": 0.5, "margin": 0.2, "max_violation": False, "warmup_epochs": 0,
                                       "direction": "c2i"}
    assert set(tree) == {f.name for f in dataclasses.fields(Config)}


def test_to_dict_and_flatten_agree_on_every_key():
    cfg = non_default()
    flat = flatten(cfg)
    assert sorted(flat) == valid_keys()
    assert flat["model.hidden"] == (1024, 512, 7)
    assert to_dict(cfg)["model"]["hidden"] == [1024, 512, 7]  # lists for TOML/JSON


def test_from_dict_starts_from_the_given_base():
    base = with_values(Config(), {"optim.lr": 0.5})
    cfg = from_dict({"train": {"epochs": 3}}, base=base)
    assert (cfg.optim.lr, cfg.train.epochs) == (0.5, 3)


def test_load_toml_errors_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        load_toml(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\nkind = 'mlp'\n")
    with pytest.raises(ConfigError, match="malformed TOML"):
        load_toml(bad)


# ---------------------------------------------------------------------------------------------- coercion

@pytest.mark.parametrize("key, raw, expected", [
    ("model.hidden", "1024,512", (1024, 512)),
    ("model.hidden", "[256, 128]", (256, 128)),
    ("model.hidden", "64", (64,)),
    ("model.hidden", [32, 16], (32, 16)),
    ("model.residual", "true", True),
    ("model.residual", "False", False),
    ("model.residual", "1", True),
    ("model.residual", 0, False),
    ("train.epochs", "3", 3),
    ("train.epochs", 4.0, 4),
    ("optim.lr", "1e-3", 1e-3),
    ("optim.lr", 2, 2.0),
    ("data.salt", "abc", "abc"),
])
def test_with_values_coerces_types(key, raw, expected):
    cfg = with_values(Config(), {key: raw})
    value = flatten(cfg)[key]
    assert value == expected
    assert type(value) is type(expected)


@pytest.mark.parametrize("key, raw", [
    ("train.epochs", 2.5),
    ("train.epochs", "2.5"),
    ("train.epochs", True),
    ("train.epochs", "three"),
    ("optim.lr", float("nan")),
    ("optim.lr", "nan"),
    ("optim.lr", float("inf")),
    ("optim.lr", "-inf"),
    ("optim.lr", True),
    ("model.residual", "maybe"),
    ("model.residual", 2),
    ("model.hidden", "1024;512"),
    ("model.hidden", [1.5]),
    ("model.hidden", 64),
    ("data.salt", 3),
])
def test_with_values_rejects_bad_types(key, raw):
    with pytest.raises(ConfigError, match=f"^{key}: expected"):
        with_values(Config(), {key: raw})


@pytest.mark.parametrize("key, raw, message", [
    ("data.val_ratio", 0.95, "above the maximum 0.9"),
    ("data.val_ratio", 0.0, "below the minimum 0.01"),
    ("train.epochs", 0, "below the minimum 1"),
    ("model.dropout", -0.1, "below the minimum 0.0"),
    ("optim.beta2", 1.5, "above the maximum 1.0"),
    ("model.hidden", "64,0", "0 is below the minimum 1"),
    ("model.hidden", [-5], "-5 is below the minimum 1"),
])
def test_range_errors(key, raw, message):
    with pytest.raises(ConfigError, match=message) as info:
        with_values(Config(), {key: raw})
    assert str(info.value).startswith(key)
    assert "\n" not in str(info.value)


def test_range_bounds_are_inclusive():
    cfg = with_values(Config(), {"data.val_ratio": 0.9, "model.dropout": 0.0, "train.epochs": 1})
    assert (cfg.data.val_ratio, cfg.model.dropout, cfg.train.epochs) == (0.9, 0.0, 1)


def test_choice_error_lists_choices_and_closest():
    with pytest.raises(ConfigError) as info:
        with_values(Config(), {"model.activation": "gleu"})
    msg = str(info.value)
    assert "model.activation" in msg and "gelu, relu, silu, tanh" in msg
    assert "did you mean 'gelu'" in msg


@pytest.mark.parametrize("key, raw, closest_value", [
    ("train.monitor", "val/los", "val/loss"), ("loss.triplet.direction", "c2I", "c2i"),
    ("loss.queue_infonce.slice_mode", "step", "stepwise"),
])
def test_recipe_knob_choices_name_the_closest(key, raw, closest_value):
    with pytest.raises(ConfigError, match=f"did you mean '{closest_value}'"):
        with_values(Config(), {key: raw})


def test_recipe_knob_defaults_keep_the_previous_behaviour():
    cfg = Config()
    assert (cfg.loss.triplet.direction, cfg.loss.queue_infonce.slice_mode, cfg.loss.queue_infonce.in_batch,
            cfg.train.monitor, cfg.model.bias) == ("both", "linear", True, "val/mrr", True)


def test_choice_accepts_listed_value():
    assert with_values(Config(), {"model.norm": "layernorm"}).model.norm == "layernorm"


def test_coerce_does_not_touch_the_config():
    assert coerce("train.batch_size", "64") == 64
    assert Config().train.batch_size == 256


# ---------------------------------------------------------------------------------------------- unknown keys

def test_unknown_key_names_closest():
    with pytest.raises(ConfigError, match=r"unknown config key 'loss\.triplet\.margn' "
                                          r"\(did you mean 'loss\.triplet\.margin'\?\)"):
        with_values(Config(), {"loss.triplet.margn": 0.1})
    with pytest.raises(ConfigError, match="did you mean 'optim.lr'"):
        check_key("optim.lrr")


def test_section_is_not_a_key():
    with pytest.raises(ConfigError, match="unknown config key 'loss.triplet'"):
        with_values(Config(), {"loss.triplet": 0.1})


def test_from_dict_unknown_section_names_closest():
    with pytest.raises(ConfigError, match=r"train\.toml: unknown config section 'optimm' \(did you mean 'optim'\?\)"):
        from_dict({"optimm": {"lr": 0.1}}, where="train.toml")
    with pytest.raises(ConfigError, match=r"unknown config section 'loss\.tripplet' "
                                          r"\(did you mean 'loss\.triplet'\?\)"):
        from_dict({"loss": {"tripplet": {"weight": 1.0}}})


def test_from_dict_unknown_key_names_closest():
    with pytest.raises(ConfigError, match=r"cfg: unknown config key 'model\.hiden' \(did you mean 'model\.hidden'\?\)"):
        from_dict({"model": {"hiden": [64]}}, where="cfg")


def test_from_dict_checks_values():
    with pytest.raises(ConfigError, match="train.epochs: expected int"):
        from_dict({"train": {"epochs": 1.5}})


# ---------------------------------------------------------------------------------------------- overrides

def test_parse_overrides_splits_on_first_equals():
    out = parse_overrides(["loss.triplet.margin=0.3", " model.hidden = 64,32 ", "data.salt=a=b"])
    assert out == {"loss.triplet.margin": "0.3", "model.hidden": "64,32", "data.salt": "a=b"}
    cfg = with_values(Config(), out)
    assert (cfg.loss.triplet.margin, cfg.model.hidden, cfg.data.salt) == (0.3, (64, 32), "a=b")


@pytest.mark.parametrize("item", ["novalue", "=3", "  =3"])
def test_parse_overrides_rejects_malformed(item):
    with pytest.raises(ConfigError, match="not of the form key=value"):
        parse_overrides([item])


def test_parse_overrides_rejects_unknown_key_with_closest():
    with pytest.raises(ConfigError, match="did you mean 'train.epochs'"):
        parse_overrides(["train.epoch=3"])


def test_parse_overrides_empty():
    assert parse_overrides([]) == {} and parse_overrides(None) == {}


# ---------------------------------------------------------------------------------------------- immutability

def test_every_section_of_the_config_tree_is_declared_frozen():
    """The tree is shared by trials, checkpoints and the picker: a section declared without frozen=True (a new
    knob section, say) could be changed in place under them. Walks our declarations, not Python's mechanism."""
    def sections(cls):
        yield cls
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(f.type if isinstance(f.type, type) else None):
                yield from sections(f.type)
            elif f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory):
                yield from sections(f.default_factory)

    found = list(sections(Config))
    assert len(found) > 10  # the walk reaches the nested sections (loss.triplet, ...)
    assert [c.__name__ for c in found if not c.__dataclass_params__.frozen] == []


def test_with_values_returns_a_copy():
    cfg = Config()
    new = with_values(cfg, {"loss.triplet.margin": 0.5, "train.epochs": 2})
    assert (cfg.loss.triplet.margin, cfg.train.epochs) == (0.2, 20)
    assert (new.loss.triplet.margin, new.train.epochs) == (0.5, 2)
    assert new.loss.infonce is cfg.loss.infonce  # untouched sub-trees are shared, not rebuilt


def test_every_float_default_is_finite_and_in_range():
    for key, value in flatten(Config()).items():
        assert coerce(key, value) == value, key
        if isinstance(value, float):
            assert math.isfinite(value), key


# ---------------------------------------------------------------------------------------------- moved knobs

@pytest.mark.parametrize("use", [
    lambda: check_key("queue.size"),
    lambda: with_values(Config(), {"queue.size": 64}),
    lambda: parse_overrides(["queue.size=64"]),
    lambda: from_dict({"queue": {"size": 64}}),
])
def test_the_queue_section_moved_under_its_loss_and_old_names_say_where(use):
    with pytest.raises(ConfigError, match=r"moved to 'loss\.queue_infonce(\.size)?'"):
        use()


def test_stored_configs_with_the_old_queue_section_are_upgraded():
    old = {"loss": {"queue_infonce": {"weight": 1.0}}, "queue": {"size": 64, "in_batch": False},
           "model": {"hidden": [8, 4]}}
    cfg = from_dict(upgrade_tree(old))
    assert (cfg.loss.queue_infonce.weight, cfg.loss.queue_infonce.size, cfg.loss.queue_infonce.in_batch,
            cfg.model.hidden) == (1.0, 64, False, (8, 4))
    assert upgrade_tree(to_dict(cfg)) == to_dict(cfg)
