"""Search spaces: parse and validate `[space]` entries (float/int/categorical, conditions) and sample them from a trial.

An entry is keyed by a config key and holds `type` ("float" | "int" | "categorical"), `low`/`high`/`log`/`step` or
`choices`, and optionally `when`: a condition string (or list of them, all must hold) of the form
`KEY OP VALUE` with OP in ==, !=, >, >=, <, <=, in (VALUE a Python literal), e.g. `"loss.slot_infonce.weight > 0"`.
A knob whose condition is false is not sampled: it keeps its base value and is absent from the trial's params.

One knob may have several entries, one per branch, named `KEY#LABEL` (e.g. `"model.hidden#deep"` with
`when = "model.kind == 'deep_mlp'"`): each is its own Optuna parameter (Optuna refuses a categorical whose choices
change between trials), and their conditions must never hold together (`latentsweep.search.study.branches` checks it).
"""
from __future__ import annotations

import ast
import operator
import re
from dataclasses import dataclass
from typing import Any

import optuna

from latentsweep.trainers.config.tree import check_key, coerce, key_hint, valid_keys
from latentsweep.trainers.core.errors import ConfigError, closest

OPS = {"==": operator.eq, "!=": operator.ne, ">": operator.gt, ">=": operator.ge, "<": operator.lt,
       "<=": operator.le, "in": lambda a, b: a in b}
_COND = re.compile(r"^\s*([A-Za-z_][\w.]*)\s*(==|!=|>=|<=|>|<|\bin\b)\s*(.+?)\s*$")
TYPES = ("float", "int", "categorical")
ENTRY_KEYS = {"type", "low", "high", "log", "step", "choices", "when"}


@dataclass(frozen=True)
class Condition:
    key: str
    op: str
    value: Any

    def holds(self, values: dict[str, Any]) -> bool:
        return bool(OPS[self.op](values[self.key], self.value))

    def __str__(self) -> str:
        return f"{self.key} {self.op} {self.value!r}"


@dataclass(frozen=True)
class Param:
    name: str  # the Optuna parameter: KEY, or KEY#LABEL for one branch of a knob with several entries
    type: str
    low: float | None = None
    high: float | None = None
    log: bool = False
    step: float | None = None
    choices: tuple | None = None
    when: tuple[Condition, ...] = ()

    @property
    def key(self) -> str:
        """The config key the entry writes."""
        return config_key(self.name)

    def suggest(self, trial) -> Any:
        if self.type == "categorical":
            return trial.suggest_categorical(self.name, list(self.choices))
        if self.type == "int":
            return trial.suggest_int(self.name, int(self.low), int(self.high), step=int(self.step or 1), log=self.log)
        return trial.suggest_float(self.name, self.low, self.high, step=self.step, log=self.log)

    def active(self, values: dict[str, Any]) -> bool:
        return all(c.holds(values) for c in self.when)

    def distribution(self) -> optuna.distributions.BaseDistribution:
        """The Optuna distribution suggest() asks for (to compare with what a stored study recorded)."""
        if self.type == "categorical":
            return optuna.distributions.CategoricalDistribution(list(self.choices))
        if self.type == "int":
            return optuna.distributions.IntDistribution(int(self.low), int(self.high), log=self.log,
                                                        step=int(self.step or 1))
        return optuna.distributions.FloatDistribution(self.low, self.high, log=self.log, step=self.step)

    def contains(self, value: Any) -> bool:
        if self.type == "categorical":
            return value in self.choices
        return self.low <= value <= self.high


def config_key(name: str) -> str:
    """`model.hidden#deep` -> `model.hidden`."""
    return name.split("#", 1)[0]


def flatten_space(table: dict[str, Any], prefix: str = "") -> dict[str, dict]:
    """Accept both quoted dotted keys ("loss.triplet.margin" = {...}) and nested TOML tables."""
    out: dict[str, dict] = {}
    for name, value in table.items():
        key = f"{prefix}{name}"
        if isinstance(value, dict) and "type" not in value and not (set(value) & ENTRY_KEYS):
            out.update(flatten_space(value, key + "."))
        else:
            out[key] = value
    return out


# The branch check probes each value of each entry against all the others: bounded so it answers in seconds.
# Twice the largest shipped study (studies/full.toml, 65 entries).
MAX_ENTRIES = 128


def parse_space(table: dict[str, Any], fixed: set[str], errors: list[str], where: str) -> list[Param]:
    """Parse `[space]`; append one line per problem to `errors`; return params ordered so conditions come first."""
    params: dict[str, Param] = {}
    entries = flatten_space(table)
    if len(entries) > MAX_ENTRIES:
        errors.append(f"{where}: space has {len(entries)} entries; at most {MAX_ENTRIES} are supported (checking "
                      f"every branch takes time quadratic in the entries)")
        return []
    for name, spec in entries.items():
        param = _parse_param(name, spec, errors, where)
        if param is not None:
            params[name] = param
    searched = {p.key for p in params.values()}
    for param in params.values():
        if param.name != param.key and not param.when:
            errors.append(f"{where}: space.{param.name}: a branch entry needs a 'when' condition")
        for cond in param.when:
            if cond.key == param.key:
                errors.append(f"{where}: space.{param.name}: condition on itself")
            elif cond.key not in searched and cond.key not in fixed:
                hint = "" if cond.key in valid_keys() else key_hint(cond.key)
                errors.append(f"{where}: space.{param.name}: condition on '{cond.key}', which is neither searched "
                              f"nor fixed in [base]{hint}")
    return _order(params, errors, where)


def _parse_param(name: str, spec: Any, errors: list[str], where: str) -> Param | None:
    at, key = f"{where}: space.{name}", config_key(name)
    if name != key and not re.fullmatch(r"\w+", name[len(key) + 1:]):
        errors.append(f"{at}: a branch label after '#' must be a word such as 'deep', got {name[len(key) + 1:]!r}")
        return None
    try:
        check_key(key)
    except ConfigError as exc:
        errors.append(f"{where}: space: {exc}")
        return None
    if not isinstance(spec, dict):
        errors.append(f"{at}: expected a table like {{type = \"float\", low = ..., high = ...}}, got {spec!r}")
        return None
    unknown = set(spec) - ENTRY_KEYS
    if unknown:
        field_name = sorted(unknown)[0]
        errors.append(f"{at}: unknown field '{field_name}'{closest(field_name, ENTRY_KEYS)}")
    kind = spec.get("type", "categorical" if "choices" in spec else None)
    if kind not in TYPES:
        errors.append(f"{at}: type must be one of {', '.join(TYPES)}{closest(str(kind), TYPES)}")
        return None
    when = _parse_conditions(spec.get("when", ()), at, errors)
    if kind == "categorical":
        return _parse_categorical(name, spec, when, at, errors)
    return _parse_range(name, kind, spec, when, at, errors)


def _parse_categorical(name, spec, when, at, errors) -> Param | None:
    key = config_key(name)
    choices = spec.get("choices")
    if not isinstance(choices, list) or not choices:
        errors.append(f"{at}: categorical needs a non-empty list 'choices'")
        return None
    if len(set(map(repr, choices))) != len(choices):
        errors.append(f"{at}: choices contain duplicates")
    for choice in choices:
        if isinstance(choice, (list, dict)):
            errors.append(f"{at}: choice {choice!r}: use a string such as \"1024,1024\" for lists")
            return None
        _check_value(key, choice, at, errors)
    return Param(name, "categorical", choices=tuple(choices), when=when)


def _parse_range(name, kind, spec, when, at, errors) -> Param | None:
    key = config_key(name)
    low, high = spec.get("low"), spec.get("high")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (low, high)):
        errors.append(f"{at}: {kind} needs numeric 'low' and 'high'")
        return None
    log, step = bool(spec.get("log", False)), spec.get("step")
    if low > high:
        errors.append(f"{at}: inverted range: low {low} > high {high}")
    elif low == high:
        errors.append(f"{at}: empty range: low == high == {low} (fix it in [base] instead)")
    if log and low <= 0:
        errors.append(f"{at}: log scale needs low > 0, got {low}")
    if log and step is not None:
        errors.append(f"{at}: 'step' and 'log' cannot be combined (Optuna rejects it)")
    if kind == "int" and not all(float(v).is_integer() for v in (low, high)):
        errors.append(f"{at}: int range needs whole numbers")
    if step is not None and (not isinstance(step, (int, float)) or step <= 0):
        errors.append(f"{at}: step must be > 0")
    elif kind == "int" and step is not None and not float(step).is_integer():
        errors.append(f"{at}: int step must be a whole number, got {step}")  # Param.suggest would truncate it
    for bound in (low, high):
        _check_value(key, bound, at, errors)
    return Param(name, kind, low=low, high=high, log=log, step=step, when=when)


def _check_value(key: str, value: Any, at: str, errors: list[str]) -> None:
    try:
        coerce(key, value)
    except ConfigError as exc:
        errors.append(f"{at}: {exc}")


def _parse_conditions(raw: Any, at: str, errors: list[str]) -> tuple[Condition, ...]:
    # A non-string, non-list `when` (e.g. a number) is reported per item below instead of crashing list().
    items = list(raw) if isinstance(raw, (list, tuple)) else [raw]
    out = []
    for text in items:
        match = _COND.match(text) if isinstance(text, str) else None
        if match is None:
            errors.append(f"{at}: condition {text!r} is not of the form 'KEY OP VALUE' (OP: {', '.join(OPS)})")
            continue
        key, op, literal = match.groups()
        try:
            value = ast.literal_eval(literal)
        except (ValueError, SyntaxError):
            errors.append(f"{at}: condition {text!r}: {literal!r} is not a literal (quote strings)")
            continue
        try:
            value = _typed_literal(key, op, value)
        except ConfigError as exc:
            errors.append(f"{at}: condition {text!r}: {exc}")
            continue
        out.append(Condition(key, op, value))
    return tuple(out)


def _typed_literal(key: str, op: str, value: Any) -> Any:
    """The literal in the knob's own type: a mismatch (`model.kind > 0`) would otherwise raise mid-study, and
    `model.hidden == '1024'` must compare with the sampled (1024,). Unknown keys are reported by parse_space."""
    if key not in valid_keys():
        return value
    if op != "in":
        return coerce(key, value)
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"'in' needs a list such as ['a', 'b'], got {value!r}")
    return tuple(coerce(key, v) for v in value)


def _order(params: dict[str, Param], errors: list[str], where: str) -> list[Param]:
    """Topological order: an entry comes after every entry (of any branch) of each knob its condition reads."""
    ordered: list[Param] = []
    pending = dict(params)
    while pending:
        unplaced = {p.key for p in pending.values()}
        ready = [p for p in pending.values() if not any(c.key in unplaced for c in p.when)]
        if not ready:
            errors.append(f"{where}: space: conditions form a cycle among {', '.join(sorted(pending))}")
            return ordered + list(pending.values())
        for p in ready:
            ordered.append(p)
            del pending[p.name]
    return ordered


def sample(trial, space: list[Param], base_values: dict[str, Any]) -> dict[str, Any]:
    """Suggest every active knob from `trial`; returns {config key: value} for the sampled ones only."""
    current = dict(base_values)
    chosen: dict[str, Any] = {}
    for param in space:
        if param.active(current):
            chosen[param.key] = current[param.key] = coerce(param.key, param.suggest(trial))
    return chosen


def active_values(space: list[Param], base_values: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """{Optuna parameter name: value} for the `values` (config keys, e.g. an enqueued recipe) that the space would
    sample, in sampling order."""
    current = {**base_values, **values}
    return {p.name: values[p.key] for p in space if p.key in values and p.active(current)}
