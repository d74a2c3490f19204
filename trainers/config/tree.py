"""The configuration tree's behaviour: built from TOML and `key=value` overrides, checked strictly, flattened, dumped.

Keys are dotted paths (`loss.triplet.margin`). A study's search space writes into the same paths with `with_values`.
The section dataclasses live in `latentsweep.trainers.config.knobs` (re-exported here); registry-backed names (model
kind, optimiser,
scheduler, losses) are checked against their registries by `latentsweep.trainers.config.validate`.
"""
from __future__ import annotations

import dataclasses
import tomllib
import typing
from dataclasses import fields, is_dataclass, replace
from pathlib import Path
from typing import Any

import tomli_w

from latentsweep.trainers.config import knobs
from latentsweep.trainers.core.errors import ConfigError, closest
from latentsweep.trainers.config.plugins import load_refs
from latentsweep.trainers.config.knobs import (MAX_SEED, MAX_WIDTH, AllImagesInfoNCECfg, AugmentCfg, Config, DataCfg, DiversityCfg,
                            EvalCfg, GeometryCfg, InfoNCECfg, LossCfg, ModelCfg, MomentCfg, MultiLabelTripletCfg,
                            OptimCfg, QueueInfoNCECfg, ScheduleCfg, SlotCfg, SlotInfoNCECfg, SlotTripletCfg, SmoothedInfoNCECfg, TemperatureCfg,
                            TrainCfg, TripletCfg, WeightCfg)

__all__ = [
    "MAX_SEED", "MAX_WIDTH", "AllImagesInfoNCECfg", "AugmentCfg", "Config", "DataCfg", "DiversityCfg", "EvalCfg", "GeometryCfg", "InfoNCECfg",
    "LossCfg", "ModelCfg", "MomentCfg", "MultiLabelTripletCfg", "OptimCfg", "QueueInfoNCECfg", "ScheduleCfg",
    "SlotCfg", "SlotInfoNCECfg", "SlotTripletCfg", "SmoothedInfoNCECfg", "TemperatureCfg", "TrainCfg", "TripletCfg",
    "WeightCfg", "MOVED", "check_key", "coerce", "dump_toml", "flatten", "flatten_tree", "from_dict", "key_hint",
    "leaf_fields", "load_toml", "moved_to", "parse_overrides", "to_dict", "upgrade_tree", "valid_keys", "with_values",
]

# Sections and keys that moved, old dotted path -> new one: an old name fails naming the new one (difflib alone does
# not reach it), and configs stored before the move (checkpoints) are read through `upgrade_tree`.
MOVED = {"queue": "loss.queue_infonce"}

# ---------------------------------------------------------------------------------------------- flattening

def flatten(cfg: Any, prefix: str = "") -> dict[str, Any]:
    """{'loss.triplet.margin': 0.2, ...} for every leaf of the tree."""
    out: dict[str, Any] = {}
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        key = f"{prefix}{f.name}"
        if is_dataclass(value):
            out.update(flatten(value, key + "."))
        else:
            out[key] = value
    return out


def flatten_tree(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested plain dict (a TOML table) as {'a.b.c': leaf}; no key checking (see `from_dict` for that)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten_tree(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def to_dict(cfg: Any) -> dict[str, Any]:
    """Nested plain dict (tuples become lists) suitable for TOML/JSON."""
    out: dict[str, Any] = {}
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        out[f.name] = to_dict(value) if is_dataclass(value) else (list(value) if isinstance(value, tuple) else value)
    return out


def leaf_fields(cls: type = Config, prefix: str = "") -> dict[str, tuple[dataclasses.Field, Any]]:
    """Every leaf key -> (its dataclass Field, its resolved Python type)."""
    hints = typing.get_type_hints(cls)
    out: dict[str, tuple[dataclasses.Field, Any]] = {}
    for f in fields(cls):
        hint = hints[f.name]
        if isinstance(hint, type) and is_dataclass(hint):
            out.update(leaf_fields(hint, f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = (f, hint)
    return out


_LEAVES: dict[int, dict[str, tuple[dataclasses.Field, Any]]] = {}


def _leaves() -> dict[str, tuple[dataclasses.Field, Any]]:
    """leaf_fields(), re-read when a plugin adds a config section (latentsweep.trainers.config.knobs.add_section)."""
    gen = knobs.generation()
    if gen not in _LEAVES:
        _LEAVES.clear()
        _LEAVES[gen] = leaf_fields()
    return _LEAVES[gen]


def valid_keys() -> list[str]:
    return sorted(_leaves())


def check_key(key: str) -> None:
    """Fail loudly on an unknown key, naming its new path (MOVED) or the closest valid one."""
    if key not in _leaves():
        raise ConfigError(f"unknown config key '{key}'{key_hint(key)}")


def moved_to(key: str) -> str | None:
    """The new path of a key or section that moved (MOVED), or None."""
    for old, new in MOVED.items():
        if key == old or key.startswith(old + "."):
            return new + key[len(old):]
    return None


def key_hint(key: str, options=None) -> str:
    """' (moved to X)' for a key or section that moved, else ' (did you mean X?)' for the closest of `options`
    (default: every valid key), or ''."""
    new = moved_to(key)
    if new is not None:
        return f" (moved to '{new}')"
    return closest(key, valid_keys() if options is None else options)


# ---------------------------------------------------------------------------------------------- values

def coerce(key: str, value: Any) -> Any:
    """Convert `value` (from TOML, a CLI string or a sampler) to the field's type, then range/choice-check it."""
    check_key(key)
    f, hint = _leaves()[key]
    try:
        value = _to_type(hint, value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}: expected {_type_name(hint)}, got {value!r}") from None
    meta = f.metadata
    if meta.get("choices") is not None and value not in meta["choices"]:
        raise ConfigError(
            f"{key}: {value!r} is not one of {', '.join(map(str, meta['choices']))}"
            f"{closest(str(value), map(str, meta['choices']))}"
        )
    items = value if isinstance(value, tuple) else (value,)
    for item in items:
        if meta.get("low") is not None and item < meta["low"]:
            raise ConfigError(f"{key}: {item!r} is below the minimum {meta['low']}")
        if meta.get("high") is not None and item > meta["high"]:
            raise ConfigError(f"{key}: {item!r} is above the maximum {meta['high']}")
    return value


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) is tuple:
        return f"a list of {typing.get_args(hint)[0].__name__}"
    return getattr(hint, "__name__", str(hint))


def _to_type(hint: Any, value: Any) -> Any:
    if typing.get_origin(hint) is tuple:
        if isinstance(value, str):
            value = [v for v in value.replace("[", "").replace("]", "").split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise TypeError
        item = typing.get_args(hint)[0]
        return tuple(_to_type(item, v.strip() if item is str and isinstance(v, str) else v) for v in value)
    if hint is bool:
        if isinstance(value, str) and value.strip().lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.strip().lower() in ("true", "1", "yes")
        if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
            return bool(value)
        raise TypeError
    if hint is int:
        if isinstance(value, bool):
            raise TypeError
        if isinstance(value, float) and not value.is_integer():
            raise ValueError
        return int(value) if not isinstance(value, str) else int(value.strip())
    if hint is float:
        if isinstance(value, bool):
            raise TypeError
        result = float(value)
        if result != result or result in (float("inf"), float("-inf")):
            raise ValueError
        return result
    if hint is str:
        if not isinstance(value, str):
            raise TypeError
        return value
    raise TypeError


def with_values(cfg: Config, values: dict[str, Any]) -> Config:
    """A copy of `cfg` with dotted-key values set (each checked); the way overrides and search spaces write."""
    nested: dict[str, Any] = {}
    for key, value in values.items():
        value = coerce(key, value)
        node = nested
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return _replace_nested(cfg, nested)


def _replace_nested(obj: Any, changes: dict[str, Any]) -> Any:
    updates = {
        name: _replace_nested(getattr(obj, name), value) if isinstance(value, dict) else value
        for name, value in changes.items()
    }
    return replace(obj, **updates)


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """['a.b=1', ...] -> {'a.b': '1'}; each key checked (values are coerced by `with_values`)."""
    out: dict[str, Any] = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"override '{item}' is not of the form key=value")
        check_key(key)
        out[key] = value.strip()
    return out


def from_dict(tree: dict[str, Any], base: Config | None = None, where: str = "config") -> Config:
    """Build a Config from a nested dict (a TOML table): every key checked, unknown ones named with the closest. The
    plugins it names (`plugins.files`) are loaded first, so that their knobs are known."""
    plugins = tree.get("plugins")
    try:
        load_refs(plugins.get("files") if isinstance(plugins, dict) else None)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    flat: dict[str, Any] = {}
    _flatten_dict(tree, "", flat, where)
    try:
        return with_values(base or Config(), flat)
    except ConfigError as exc:  # a value out of range or of the wrong type: name the file like the key errors do
        raise ConfigError(f"{where}: {exc}") from None


def upgrade_tree(tree: dict[str, Any]) -> dict[str, Any]:
    """A stored nested config (a checkpoint's) with every moved key at its new path (MOVED); otherwise as is."""
    nested: dict[str, Any] = {}
    for key, value in flatten_tree(tree).items():
        node = nested
        *parents, leaf = (moved_to(key) or key).split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return nested


def _flatten_dict(tree: dict[str, Any], prefix: str, out: dict[str, Any], where: str) -> None:
    leaves = _leaves()
    for name, value in tree.items():
        key = f"{prefix}{name}"
        if isinstance(value, dict):
            if not any(k.startswith(key + ".") for k in leaves):
                raise ConfigError(f"{where}: unknown config section '{key}'{key_hint(key, _sections())}")
            _flatten_dict(value, key + ".", out, where)
        else:
            if key not in leaves:
                raise ConfigError(f"{where}: unknown config key '{key}'{key_hint(key)}")
            out[key] = value


def _sections() -> set[str]:
    return {k.rsplit(".", 1)[0] for k in _leaves()} | {k.split(".", 1)[0] for k in _leaves()}


def load_toml(path: str | Path) -> dict[str, Any]:
    """Parse a TOML file with one-line errors for a missing file or bad syntax."""
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: malformed TOML: {exc}") from None
    except UnicodeDecodeError as exc:  # TOML is UTF-8 by definition; tomllib lets the decoder's traceback through
        line = exc.object[:exc.start].count(b"\n") + 1
        raise ConfigError(f"{path}: line {line}: not UTF-8 text (byte {exc.object[exc.start]:#04x}); "
                          f"save the file as UTF-8") from None


def dump_toml(cfg: Config) -> str:
    """The resolved config as TOML (a table per sub-config), readable back by `from_dict`."""
    return tomli_w.dumps(to_dict(cfg))
