"""Study files (`studies/*.toml`): `[study]` settings, `[base]` config, `[space]` and `[[enqueue]]`, all validated at
once.

Every problem found is reported together, one line each, before any trial runs, including every invalid config the
space can propose (each conditional branch is probed and validated, see `latentsweep.search.study.branches`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from latentsweep.search.checks import check_seconds
from latentsweep.search.stores import safe_name
from latentsweep.search.study.branches import check_branches
from latentsweep.search.study.presets import resolve_study_path
from latentsweep.search.study.samplers import DEFAULT, check_settings
from latentsweep.search.study.side import side_entry, unique
from latentsweep.search.study.space import Param, active_values, config_key, parse_space
from latentsweep.trainers.config.tree import Config, coerce, flatten, flatten_tree, from_dict, load_toml, with_values
from latentsweep.trainers.data.demo import default_train_path
from latentsweep.trainers.core.errors import ConfigError, LatentsweepError, closest
from latentsweep.trainers.config.plugins import load_plugin
from latentsweep.trainers.config.validate import validate

STUDY_KEYS = {"name", "objective", "direction", "sampler", "pruner", "n_trials", "timeout", "description", "plugins"}
TOP_KEYS = {"study", "base", "space", "enqueue", "side"}
DIRECTIONS = ("maximize", "minimize")


@dataclass(frozen=True)
class StudyFile:
    path: Path
    name: str
    objective: str = "val/mrr"
    direction: str = "maximize"
    sampler: dict[str, Any] = field(default_factory=lambda: {"name": DEFAULT["sampler"]})
    pruner: dict[str, Any] = field(default_factory=lambda: {"name": DEFAULT["pruner"]})
    n_trials: int = 20
    timeout: float | None = None
    base: Config = field(default_factory=Config)
    fixed: frozenset[str] = frozenset()  # keys set explicitly in [base]
    space: tuple[Param, ...] = ()
    enqueue: tuple[dict[str, Any], ...] = ()
    side: tuple[dict[str, Any], ...] = ()  # [[side]]: configs run once beside the search (search/study/side.py)
    description: str = ""
    plugins: tuple[str, ...] = ()  # `PATH#sha256=HEX` of each plugin file (also in base.plugins.files)


def load_study_file(path: str | Path) -> StudyFile:
    """Parse and validate a study file (a path, or a preset's name); raise ConfigError listing every problem (one per
    line)."""
    path = resolve_study_path(path)
    raw = load_toml(path)
    where = str(path)
    errors: list[str] = []
    for key in raw:
        if key not in TOP_KEYS:
            errors.append(f"{where}: unknown table [{key}]{closest(key, TOP_KEYS)}")
    study = _study_settings(raw.get("study", {}), path, errors)
    plugins = load_plugins(raw.get("study", {}), path)  # before [base]: their knobs are config keys
    parsed = len(errors)
    base, fixed = _base(raw.get("base", {}), where, errors)
    if plugins:
        base = with_values(base, {"plugins.files": plugins})
    if len(errors) == parsed:  # [base] parsed: it must also be a valid config on its own
        _check_base(base, where, errors)
    space = parse_space(raw.get("space", {}), fixed, errors, where)
    enqueue = [_enqueue_entry(e, i, path, base, space, errors)
               for i, e in enumerate(_tables(raw, "enqueue", where, errors))]
    side = [side_entry(e, i, where, base, errors) for i, e in enumerate(_tables(raw, "side", where, errors))]
    if not errors:  # probing needs a space that parsed; every config it proposes must pass the trainer's check
        check_branches(space, base, [e for e in enqueue if e], errors, where)
    if errors:
        raise ConfigError(f"{len(errors)} problem(s) in {where}:\n  " + "\n  ".join(errors))
    return StudyFile(path=path, base=base, fixed=frozenset(fixed), space=tuple(space),
                     enqueue=tuple(e for e in enqueue if e), side=unique(side),
                     plugins=tuple(plugins), **study)


def load_plugins(table: dict, path: Path) -> list[str]:
    """Import the study's `plugins` (files beside the study file, or absolute paths); their refs. A broken plugin
    stops here, before trial 0, in one line naming its file and line."""
    files = table.get("plugins", [])
    if isinstance(files, str):
        files = [files]
    if not isinstance(files, list) or not all(isinstance(f, str) and f for f in files):
        raise ConfigError(f"{path}: study.plugins: expected a list of Python file names, got {files!r}")
    try:
        return [load_plugin((path.parent / Path(f).expanduser()).resolve()) for f in files]
    except ConfigError as exc:
        raise ConfigError(f"{exc} (a plugin of {path})") from None


def _study_settings(table: dict, path: Path, errors: list[str]) -> dict[str, Any]:
    where = str(path)
    for key in table:
        if key not in STUDY_KEYS:
            errors.append(f"{where}: study.{key}: unknown setting{closest(key, STUDY_KEYS)}")
    out: dict[str, Any] = {"name": str(table.get("name", path.stem))}
    try:
        safe_name(out["name"], "study.name")
    except LatentsweepError as exc:
        errors.append(f"{where}: {exc}")
    out["objective"] = str(table.get("objective", "val/mrr"))
    out["description"] = str(table.get("description", ""))
    direction = table.get("direction", "maximize")
    if direction not in DIRECTIONS:
        errors.append(f"{where}: study.direction: must be maximize or minimize{closest(str(direction), DIRECTIONS)}")
    out["direction"] = direction
    for kind in ("sampler", "pruner"):
        sub = table.get(kind, {})
        sub = {"name": sub} if isinstance(sub, str) else sub
        if not isinstance(sub, dict):
            errors.append(f"{where}: study.{kind}: expected a name or a table")
            sub = {}
        check_settings(kind, sub, errors, where)
        out[kind] = sub or {"name": DEFAULT[kind]}
    n_trials = table.get("n_trials", 20)
    if not isinstance(n_trials, int) or isinstance(n_trials, bool) or n_trials < 1:
        errors.append(f"{where}: study.n_trials: must be a whole number >= 1, got {n_trials!r}")
    out["n_trials"] = n_trials
    timeout = table.get("timeout")
    try:
        if timeout is not None:
            check_seconds("study.timeout", timeout)
    except LatentsweepError as exc:
        errors.append(f"{where}: {exc}")
    out["timeout"] = timeout
    return out


def _tables(raw: dict, key: str, where: str, errors: list[str]) -> list[dict]:
    """The `[[key]]` array of tables (none when absent); one error line when it is something else."""
    tables = raw.get(key, [])
    if isinstance(tables, list) and all(isinstance(t, dict) for t in tables):
        return tables
    errors.append(f"{where}: {key}: expected [[{key}]] tables, got {type(tables).__name__}")
    return []


def _base(table: dict, where: str, errors: list[str]) -> tuple[Config, set[str]]:
    """The base config and the keys it sets explicitly (conditions may only read searched or fixed knobs)."""
    try:
        return from_dict(table, where=f"{where}: base"), set(flatten_tree(table))
    except ConfigError as exc:
        errors.append(str(exc))
        return Config(), set()


def _check_base(base: Config, where: str, errors: list[str]) -> None:
    """[base] must be a valid config on its own; if not, its problem is said as [base]'s, once, and nothing built on
    it is checked (every [[side]] and [[enqueue]] entry would repeat it under its own name)."""
    try:
        validate(base)
    except ConfigError as exc:
        errors.append(f"{where}: base: an invalid config: {exc}")
        raise ConfigError(f"{len(errors)} problem(s) in {where}:\n  " + "\n  ".join(errors)) from None


def _enqueue_entry(entry: dict, index: int, path: Path, base: Config, space: list[Param],
                   errors: list[str]) -> dict[str, Any]:
    """A known-good config to try first: explicit knob values, or `recipe = "other.toml"` (its [base])."""
    at = f"{path}: enqueue[{index}]"
    searched = {p.key for p in space}
    entry = dict(entry)
    recipe = entry.pop("recipe", None)
    values: dict[str, Any] = {}
    if recipe is not None and not (isinstance(recipe, str) and recipe.strip()):
        errors.append(f"{at}: recipe must be the file name of a study file (a string), got {recipe!r}")
        return {}
    if recipe is not None:
        if (path.parent / recipe).resolve() == path.resolve():
            other_base = base  # the file's own recipe: its [base] is the known-good config
        else:
            # Only the other file's [base] is read: loading it whole would follow its own [[enqueue]] recipes,
            # and two files naming each other would recurse forever.
            recipe_errors: list[str] = []
            try:
                other_base, _ = _base(load_toml(path.parent / recipe).get("base", {}),
                                      str(path.parent / recipe), recipe_errors)
            except LatentsweepError as exc:
                recipe_errors.append(str(exc))
            if recipe_errors:
                errors.append(f"{at}: recipe {recipe}: {recipe_errors[0]}")
                return {}
        mine, theirs = flatten(base), flatten(other_base)
        for key, value in theirs.items():
            if key in searched:
                values[key] = value
            # data.* (file, split, val ratio) belongs to the study, not the recipe: every trial of one study shares
            # one val split so that their values compare; plugins.* is the study's too (from [study] plugins).
            elif value != mine[key] and not key.startswith(("data.", "plugins.")):
                errors.append(f"{at}: recipe {recipe} sets {key}={value!r} (base has {mine[key]!r}) "
                              f"but {key} is not searched")
    for key, value in flatten_tree(entry).items():
        if key not in searched:
            errors.append(f"{at}: '{key}' is not a searched knob{closest(key, searched)}")
            continue
        try:  # typed before conditions and ranges compare it (a string would raise TypeError there)
            values[key] = coerce(key, value)
        except ConfigError as exc:
            errors.append(f"{at}: {exc}")
    base_values = flatten(base)
    active = active_values(space, base_values, values)
    by_name = {p.name: p for p in space}
    for key, value in values.items():
        if key not in {config_key(n) for n in active} and value != base_values[key]:
            conditions = " or ".join(f"({', '.join(map(str, p.when))})" for p in space if p.key == key)
            errors.append(f"{at}: {key}={value!r} would be ignored: its condition {conditions} "
                          f"does not hold for this entry")
    for name, value in active.items():
        param = by_name[name]
        shown = ",".join(map(str, value)) if isinstance(value, tuple) else value
        if not param.contains(shown if param.type == "categorical" else value):
            errors.append(f"{at}: {param.key}={shown!r} lies outside the searched space ({name})")
        elif isinstance(value, tuple):
            active[name] = shown
    return active


def resolve_data_path(value: str | Path | None) -> Path:
    """The train npz to use: the given path, else the bundled demo data."""
    if value:
        return Path(value).expanduser()

    return default_train_path()
