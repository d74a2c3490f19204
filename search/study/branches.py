"""The study-file check that a space proposes only valid configs: probe every branch, validate each probed config.

Probes are deterministic. For every entry and each of its probe values (every choice of a categorical; the bounds
of a range and both sides of every condition threshold inside it), one config sets that value with the entry's
conditions made true, and one more per value of each knob those conditions read (so `model.hidden` is probed under
every `model.kind` that activates it). The rest of each probe is drawn from the same probe values by a seeded RNG.
Every probed config goes through `latentsweep.trainers.config.validate.validate`, the check the trainer itself runs
first.
"""
from __future__ import annotations

import math
import random
from typing import Any

from latentsweep.search.study.space import Param, config_key
from latentsweep.trainers.config.tree import Config, coerce, flatten, with_values
from latentsweep.trainers.core.errors import LatentsweepError
from latentsweep.trainers.config.validate import validate

# Retries of a probe whose forced values stayed inactive (a condition further up the chain drew the other way)
_RETRIES = 8


def check_branches(space: list[Param], base: Config, enqueued: list[dict[str, Any]], errors: list[str],
                   where: str) -> None:
    """Append one line per distinct problem found in a probed or enqueued config (with the values that cause it)."""
    base_values = flatten(base)
    found: dict[str, str] = {}
    # each entry's probe values once: recomputed per probe they made validation cubic in the entries
    choices = {p.name: probe_values(p, space) for p in space}
    for forced in _targets(space, choices):
        for attempt in range(_RETRIES):
            values, clash = _probe(space, base_values, forced, random.Random(attempt), choices)
            if clash or all(values.get(name) == v for name, v in forced.items()):
                break
        shown = _shown(values, forced, space)
        if clash:
            found.setdefault(clash, f"{where}: space: {clash} (with {shown})")
            continue
        _validate_into(found, validate, base, values, f"{where}: space proposes an invalid config (with {shown})")
    for index, values in enumerate(enqueued):
        _validate_into(found, validate, base, values, f"{where}: enqueue[{index}] is an invalid config")
    errors.extend(found.values())


def _shown(values: dict[str, Any], forced: dict[str, Any], space: list[Param]) -> str:
    """The probe's forced values and its categorical and int choices: the values that pick a branch."""
    branching = {p.name for p in space if p.type in ("categorical", "int")}
    return ", ".join(f"{k}={v!r}" for k, v in values.items() if k in forced or k in branching) or "the base"


def _validate_into(found: dict[str, str], validate, base: Config, values: dict[str, Any], prefix: str) -> None:
    """Validate base + values ({Optuna name: value}); record the first line of a new problem once."""
    try:
        validate(with_values(base, {config_key(name): value for name, value in values.items()}))
    except LatentsweepError as exc:
        message = str(exc).splitlines()[0]
        found.setdefault(message, f"{prefix}: {message}")


def _targets(space: list[Param], choices: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """Forced {name: value} sets: each probe value of each entry, alone and with each value of each knob its
    conditions read that makes them hold."""
    by_key: dict[str, list[Param]] = {}
    for p in space:
        by_key.setdefault(p.key, []).append(p)
    targets: list[dict[str, Any]] = []
    for param in space:
        for value in choices[param.name]:
            forced = {param.name: value}
            gates = _satisfying_gates(param, by_key, choices)
            targets.append({**{g.name: v[0] for g, v in gates if v}, **forced})
            for gate, gate_values in gates:
                targets.extend({**forced, gate.name: v} for v in gate_values[1:])
    return targets


def _satisfying_gates(param: Param, by_key: dict[str, list[Param]], choices: dict[str, list[Any]]):
    """[(gate entry, its probe values that satisfy param's conditions on it)] for each searched knob read."""
    out = []
    for cond in param.when:
        for gate in by_key.get(cond.key, ()):
            out.append((gate, [v for v in choices[gate.name] if cond.holds({cond.key: coerce(gate.key, v)})]))
    return out


def probe_values(param: Param, space: list[Param]) -> list[Any]:
    """Every choice of a categorical; a range's bounds and both sides of each threshold other entries compare with."""
    if param.type == "categorical":
        return list(param.choices)
    points = {param.low, param.high}
    for other in space:
        for cond in other.when:
            if cond.key == param.key and isinstance(cond.value, (int, float)) and not isinstance(cond.value, bool):
                points.update(_around(param, cond.value))
    return sorted(v for v in points if param.contains(v))


def _around(param: Param, threshold: float) -> list[float]:
    if param.type == "int":
        return [math.floor(threshold), math.floor(threshold) + 1, math.ceil(threshold) - 1]
    # the threshold itself and a value just above it: one side of `>` and one of `>=` each
    return [threshold, threshold * (1 + 1e-6) if threshold else 1e-9]


def _probe(space: list[Param], base_values: dict[str, Any], forced: dict[str, Any], rng: random.Random,
           choices: dict[str, list[Any]]) -> tuple[dict[str, Any], str | None]:
    """One probed assignment {name: value} (forced values where the entry is active), and a clash message if two
    entries of one knob were active together."""
    current = dict(base_values)
    chosen: dict[str, Any] = {}
    written: dict[str, str] = {}
    for param in space:
        if not param.active(current):
            continue
        if param.key in written:
            return chosen, (f"{written[param.key]} and {param.name} are both active: their conditions "
                            f"({_show(written, param, space)}) must exclude each other")
        value = forced[param.name] if param.name in forced else rng.choice(choices[param.name])
        chosen[param.name] = value
        written[param.key] = param.name
        current[param.key] = coerce(param.key, value)
    return chosen, None


def _show(written: dict[str, str], param: Param, space: list[Param]) -> str:
    other = next(p for p in space if p.name == written[param.key])
    return "; ".join(", ".join(map(str, p.when)) or "always" for p in (other, param))

