"""Sampler and pruner registries: `[study.sampler]` / `[study.pruner]` tables (name + keyword settings) to Optuna objects."""
from __future__ import annotations

import inspect
import os
from typing import Any

import optuna

from trainers.errors import closest
from trainers.registry import Registry

SAMPLERS: Registry = Registry("sampler")
PRUNERS: Registry = Registry("pruner")

SAMPLERS.register("tpe")(optuna.samplers.TPESampler)
SAMPLERS.register("random")(optuna.samplers.RandomSampler)
SAMPLERS.register("cmaes")(optuna.samplers.CmaEsSampler)
SAMPLERS.register("gp")(optuna.samplers.GPSampler)
SAMPLERS.register("qmc")(optuna.samplers.QMCSampler)

PRUNERS.register("median")(optuna.pruners.MedianPruner)
PRUNERS.register("percentile")(optuna.pruners.PercentilePruner)
PRUNERS.register("asha")(optuna.pruners.SuccessiveHalvingPruner)
PRUNERS.register("successive_halving")(optuna.pruners.SuccessiveHalvingPruner)
PRUNERS.register("hyperband")(optuna.pruners.HyperbandPruner)
PRUNERS.register("none")(optuna.pruners.NopPruner)

# Settings whose values are callables or objects cannot come from TOML; everything else is a keyword argument.
_SCALAR = (bool, int, float, str)


def check_settings(kind: str, table: dict[str, Any], errors: list[str], where: str) -> None:
    """Append one line per problem with a `[study.sampler]`/`[study.pruner]` table (unknown name or setting)."""
    registry = SAMPLERS if kind == "sampler" else PRUNERS
    name = table.get("name", "tpe" if kind == "sampler" else "median")
    if name not in registry:
        errors.append(f"{where}: study.{kind}: unknown {kind} '{name}'{closest(str(name), registry.names())}; "
                      f"valid: {', '.join(registry.names())}")
        return
    accepted = _keywords(registry.get(name))
    for key, value in table.items():
        if key == "name":
            continue
        if key not in accepted:
            errors.append(f"{where}: study.{kind}.{key}: not a setting of {kind} '{name}'{closest(key, accepted)}")
        elif not isinstance(value, _SCALAR):
            errors.append(f"{where}: study.{kind}.{key}: expected a number, string or boolean")


def _keywords(cls) -> list[str]:
    params = inspect.signature(cls).parameters.values()
    return [p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]


def build_sampler(table: dict[str, Any], per_worker: bool = False) -> optuna.samplers.BaseSampler:
    """The sampler of a `[study.sampler]` table. `per_worker`: a joining worker offsets a fixed seed by a random
    amount, since workers sharing one seed would propose identical trials; the process that creates the study keeps
    the seed, so a one-worker study stays reproducible."""
    settings = {k: v for k, v in table.items() if k != "name"}
    if per_worker and settings.get("seed") is not None:
        settings["seed"] = (int(settings["seed"]) + int.from_bytes(os.urandom(4), "big")) % 2**32
    return SAMPLERS.get(table.get("name", "tpe"))(**settings)


def build_pruner(table: dict[str, Any]) -> optuna.pruners.BasePruner:
    settings = {k: v for k, v in table.items() if k != "name"}
    return PRUNERS.get(table.get("name", "median"))(**settings)
