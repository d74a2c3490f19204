"""Side trials: configs a study runs once, beside the search, that its sampler never proposes (`[[side]]`).

Why: a model with nothing to tune (the knn model builds the same predictions whatever the searched knobs say) as
a choice of a searched categorical knob is a trap for TPE. Once it has the best value, TPE proposes it again and
again: on a demo holdout, 108 of a 10-minute study's first 117 trials rebuilt the same knn model (0.391 each time)
and the trained models stopped being searched. A side trial has no Optuna parameters, so no sampler models it; its
config is `[base]` with the entry's knob values, kept in the trial's user attribute SIDE_ATTR, read back by
latentsweep.search.study.contract.read_side (the trial's own config; for the pick, its model kind in the
best-of-each-kind pool).
"""
from __future__ import annotations

import json
from typing import Any

import optuna

from latentsweep.search.study.contract import ENQUEUED_ATTR, SIDE_ATTR
from latentsweep.trainers.config.tree import Config, coerce, flatten_tree, with_values
from latentsweep.trainers.core.errors import ConfigError
from latentsweep.trainers.config.validate import validate


# Knobs that belong to the study, not to one of its trials: every trial reads one data file, one task and one val
# split (so that their values compare), and the study's plugins ([study] plugins).
STUDY_OWNED = ("data.path", "data.task", "data.split", "data.val_ratio", "data.n_folds", "data.fold", "data.salt")


def side_entry(entry: dict, index: int, where: str, base: Config, errors: list[str]) -> dict[str, Any]:
    """{config key: value} of one `[[side]]` table, checked as a whole config on top of `base`; {} after errors."""
    at = f"{where}: side[{index}]"
    flat = flatten_tree(entry)
    values: dict[str, Any] = {}
    for key, value in flat.items():
        if key in STUDY_OWNED or key.startswith("plugins."):
            errors.append(f"{at}: {key} belongs to the study, not to one trial (set it in [base] or [study])")
            continue
        try:  # an unknown knob fails here, naming the closest valid one
            values[key] = coerce(key, value)
        except ConfigError as exc:
            errors.append(f"{at}: {exc}")
    if len(values) < len(flat):
        return {}
    if not values:
        errors.append(f"{at}: sets no knob (a side trial is [base] with at least one knob changed)")
        return {}
    try:
        validate(with_values(base, values))
    except ConfigError as exc:
        errors.append(f"{at}: an invalid config: {exc}")
        return {}
    return values


def enqueue_side(study: optuna.Study, entries: tuple[dict[str, Any], ...]) -> None:
    """Queue each side trial (no parameters: a sampler never sees it) unless the study has it already."""
    have = {t.user_attrs.get(SIDE_ATTR) for t in study.get_trials(deepcopy=False)}
    for values in entries:
        text = json.dumps(values, sort_keys=True)
        if text not in have:
            study.enqueue_trial({}, user_attrs={ENQUEUED_ATTR: True, SIDE_ATTR: text})
            have.add(text)  # two identical entries run once


def unique(entries: list[dict[str, Any]]) -> tuple[dict[str, Any], ...]:
    """The side entries without repeats (the first of identical ones kept) and without failed ones ({})."""
    seen: dict[str, dict[str, Any]] = {}
    for values in entries:
        if values:
            seen.setdefault(json.dumps(values, sort_keys=True), values)
    return tuple(seen.values())
