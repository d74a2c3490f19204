"""Sampler and pruner registries: `[study.sampler]` / `[study.pruner]` tables (name + keyword settings) to Optuna
objects, the study's sampler with some parameters fixed (`fixing`), and a sampler that learns from other studies'
trials too (`PastTrialsSampler`)."""
from __future__ import annotations

import copy
import hashlib
import inspect
import os
import warnings
from contextlib import contextmanager
from typing import Any, Iterator

import optuna

from latentsweep.trainers.core.errors import closest
from latentsweep.trainers.config.registry import Registry

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
# What a study file that names none gets (Optuna's own defaults: create_study uses TPE and the median pruner).
DEFAULT = {"sampler": "tpe", "pruner": "median"}

# Settings whose values are callables or objects cannot come from TOML; everything else is a keyword argument.
_SCALAR = (bool, int, float, str)


def check_settings(kind: str, table: dict[str, Any], errors: list[str], where: str) -> None:
    """Append one line per problem with a `[study.sampler]`/`[study.pruner]` table (unknown name or setting)."""
    registry = SAMPLERS if kind == "sampler" else PRUNERS
    name = table.get("name", DEFAULT[kind])
    if name not in registry:
        errors.append(f"{where}: study.{kind}: unknown {kind} '{name}'{closest(str(name), registry.names())}; "
                      f"valid: {', '.join(registry.names())}")
        return
    cls = registry.get(name)
    accepted = _keywords(cls)
    count = len(errors)
    for key, value in table.items():
        if key == "name":
            continue
        if key not in accepted:
            errors.append(f"{where}: study.{kind}.{key}: not a setting of {kind} '{name}'{closest(key, accepted)}")
        elif not isinstance(value, _SCALAR):
            errors.append(f"{where}: study.{kind}.{key}: expected a number, string or boolean")
        else:
            problem = _value_problem(accepted[key], value)
            if problem:
                errors.append(f"{where}: study.{kind}.{key}: {problem}")
    if len(errors) == count:  # the values themselves: Optuna's own checks run when the object is built
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                cls(**{k: v for k, v in table.items() if k != "name"})
        except (ValueError, TypeError, OverflowError) as exc:
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            errors.append(f"{where}: study.{kind}: {kind} '{name}' rejects its settings: {reason}")


def _value_problem(default: Any, value: Any) -> str | None:
    """A setting's value against the type of its default (Optuna accepts many wrong types without a word, e.g. a
    string or a negative number of startup trials, and fails only trials later). Counts (int defaults) are >= 0."""
    if isinstance(default, bool):
        return None if isinstance(value, bool) else f"expected true or false, got {value!r}"
    if isinstance(default, int) and default is not None:
        if isinstance(value, bool) or not isinstance(value, int):
            return f"expected a whole number, got {value!r}"
        return f"must be >= 0, got {value}" if value < 0 else None
    if isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            return f"expected a number, got {value!r}"
    return None


def _keywords(cls) -> dict[str, Any]:
    """Keyword settings of a sampler/pruner class and their defaults (None when the default is None or absent)."""
    params = inspect.signature(cls).parameters.values()
    return {p.name: (None if p.default is p.empty else p.default) for p in params
            if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}


def build_sampler(table: dict[str, Any], per_worker: bool = False, history: int = 0) -> optuna.samplers.BaseSampler:
    """The sampler of a `[study.sampler]` table.

    A fixed seed is kept as written for a fresh study run by one process, so that run is reproducible. Otherwise it
    is derived: `history` (trials already in the study) makes a resumed run continue the search instead of
    replaying trial 0's proposals, and `per_worker` adds a random offset, since workers joining at the same moment
    see the same history and would still propose identical trials.
    """
    settings = {k: v for k, v in table.items() if k != "name"}
    if settings.get("seed") is not None and (history or per_worker):
        salt = os.urandom(4).hex() if per_worker else ""
        digest = hashlib.sha256(f"{settings['seed']}:{history}:{salt}".encode()).digest()
        settings["seed"] = int.from_bytes(digest[:4], "big")  # numpy seeds must lie in [0, 2**32)
    return SAMPLERS.get(table.get("name", DEFAULT["sampler"]))(**settings)


def build_pruner(table: dict[str, Any]) -> optuna.pruners.BasePruner:
    settings = {k: v for k, v in table.items() if k != "name"}
    return PRUNERS.get(table.get("name", DEFAULT["pruner"]))(**settings)


class FixedWhereItFits(optuna.samplers.PartialFixedSampler):
    """Optuna's PartialFixedSampler around `base` (the study's sampler), except that a fixed value the parameter's
    distribution does not hold (a categorical without it, a number out of range) is sampled by `base` as if unfixed:
    PartialFixedSampler raises for the categorical and records the out-of-range number with a warning.

    Relative sampling (TPE multivariate, group) models the unfixed parameters jointly and never proposes a fixed
    one: PartialFixedSampler drops the fixed names from the relative search space, and a relative value returned
    for one anyway is dropped here (TPE with group=True returned them until Optuna's fix for optuna/optuna#6427; a
    relative value wins over sample_independent's fixed one in Trial._suggest). An enqueued trial's own values
    (its fixed_params) win over any sampler, so it keeps them."""

    def __init__(self, fixed: dict[str, Any], base: optuna.samplers.BaseSampler):
        with warnings.catch_warnings():  # experimental since Optuna 2.4 and unchanged since: not the user's concern
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            super().__init__(dict(fixed), base)
        self.fixed, self.base = dict(fixed), base
        self.unfit: set[str] = set()  # the fixed names sampled by `base` because their value did not fit

    def sample_relative(self, study, trial, search_space):
        params = super().sample_relative(study, trial, search_space)
        return {name: value for name, value in params.items() if name not in self.fixed}

    def sample_independent(self, study, trial, param_name, param_distribution):
        if param_name in self.fixed and not fits(param_distribution, self.fixed[param_name]):
            self.unfit.add(param_name)
            return self.base.sample_independent(study, trial, param_name, param_distribution)
        return super().sample_independent(study, trial, param_name, param_distribution)


def fits(distribution: optuna.distributions.BaseDistribution, value: Any) -> bool:
    """Whether `distribution` can hold `value` as it is (a choice of a categorical, a number within a range)."""
    if isinstance(distribution, optuna.distributions.CategoricalDistribution):
        return any(type(c) is type(value) and c == value for c in distribution.choices)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    step = getattr(distribution, "step", None)  # Optuna's own grid test (FloatDistribution._contains)
    on_grid = step is None or abs((value - distribution.low) / step - round((value - distribution.low) / step)) < 1e-8
    return distribution.low <= value <= distribution.high and on_grid


@contextmanager
def fixing(study: optuna.Study, fixed: dict[str, Any]) -> Iterator[FixedWhereItFits | None]:
    """The study asks and samples with `fixed` ({parameter: value}) held (FixedWhereItFits) inside the block: the
    sampler must stay in place from the ask (before_trial) through the suggestions (the relative sampling is lazy,
    at the first suggest). Nothing is swapped when `fixed` is empty."""
    if not fixed:
        yield None
        return
    base = study.sampler
    study.sampler = FixedWhereItFits(fixed, base)
    try:
        yield study.sampler
    finally:
        study.sampler = base


# The samplers that model a study's past trials, read through Study._get_trials (TPE: its start-up count, its
# search space and its Parzen estimators; GP: its start-up count and its Gaussian process). Random and QMC learn
# nothing from them; CMA-ES keeps its state in its own trials' system attributes (its warm start would be
# `source_trials`, not done), so none of those is wrapped.
LEARNS_FROM_PAST = ("tpe", "gp")


class _PastView:
    """The study as a wrapped sampler sees it: the past trials (numbered 0..N-1) before the study's own (renumbered
    from N: Optuna's IntersectionSearchSpace caches by trial number and assumes trials in number order). Everything
    else (directions, storage, study id) is the study itself; nothing is written to it."""

    def __init__(self, study: optuna.Study, past: tuple[optuna.trial.FrozenTrial, ...]):
        self._study, self._past = study, past

    def __getattr__(self, name: str) -> Any:
        return getattr(self._study, name)

    def _get_trials(self, deepcopy: bool = True, states=None, use_cache: bool = False) -> list:
        own = self._study._get_trials(deepcopy=False, states=states, use_cache=use_cache)
        trials = [t for t in self._past if states is None or t.state in states]
        trials += [shifted(t, len(self._past)) for t in own]
        return copy.deepcopy(trials) if deepcopy else trials

    def get_trials(self, deepcopy: bool = True, states=None) -> list:
        return self._get_trials(deepcopy, states, use_cache=False)

    @property
    def trials(self) -> list:
        return self.get_trials()


def shifted(trial: optuna.trial.FrozenTrial, by: int) -> optuna.trial.FrozenTrial:
    """A shallow copy of `trial` numbered `by` higher (its id, params and attributes shared)."""
    out = copy.copy(trial)
    out.number = trial.number + by
    return out


class PastTrialsSampler(optuna.samplers.BaseSampler):
    """`inner`, learning from `past` (finished trials of other studies, already in this study's distributions) as if
    they were this study's first trials, without adding them to it: study.trials, its storage and every reader of
    them (budget, status, pick, MLflow) see only the study's own. The past counts toward the inner sampler's start-up
    trials, so its first proposal is already model-based. The current trial is passed renumbered like the study's
    own (TPE's constant liar leaves it out by number); its id is unchanged, so what the sampler stores lands on it."""

    def __init__(self, inner: optuna.samplers.BaseSampler, past: list[optuna.trial.FrozenTrial]):
        self.inner = inner
        self.past = tuple(shifted(t, i - t.number) for i, t in enumerate(past))

    def _view(self, study, trial):
        return _PastView(study, self.past), shifted(trial, len(self.past))

    def infer_relative_search_space(self, study, trial):
        return self.inner.infer_relative_search_space(*self._view(study, trial))

    def sample_relative(self, study, trial, search_space):
        return self.inner.sample_relative(*self._view(study, trial), search_space)

    def sample_independent(self, study, trial, param_name, param_distribution):
        return self.inner.sample_independent(*self._view(study, trial), param_name, param_distribution)

    def before_trial(self, study, trial) -> None:  # the study itself: these hooks write to its trial
        self.inner.before_trial(study, trial)

    def after_trial(self, study, trial, state, values) -> None:
        self.inner.after_trial(study, trial, state, values)

    def reseed_rng(self) -> None:
        self.inner.reseed_rng()
