"""Warm start: a new study first tries the best configurations of earlier studies on the same data, else the portfolio,
and its sampler learns from their finished trials.

Same data means the same training file contents: the sha256 fingerprint of its bytes
(latentsweep.trainers.data.sets.fingerprint), which
every study records at creation (IDENTITY_ATTR), so a copied or renamed file is still the same data and an edited one
is not. Earlier studies are looked for in the study's own storage and in each `--warm-from` source (a state directory
or an Optuna storage URL); one is a source when its data fingerprint, objective metric and direction match. Their
COMPLETE trials, best first and distinct once translated into the new space (search/study/space.py), are enqueued
after the study file's side trials (cheap) and before its recipes (the earlier studies ranked those too), WARM_K at
most; each records where it came from (WARM_ATTR, and the MLflow tag of the same name). Without any source, the
bundled portfolio (portfolio.toml, written by benchmarks/portfolio.py) is enqueued after the recipes. Done once,
when the study is created (search/study/worker.py load_or_create).

The sampler (TPE or GP: samplers.LEARNS_FROM_PAST) also learns from the sources' COMPLETE trials whose values are
comparable: the same validation split too (SPLIT_KEYS), each translated as above. They are not added to the study
(Optuna's add_trials would make every reader of its trials, the budget count, `study status`, the best trial, the
pick's candidates, the one-budget reserve's trial timings, tell them apart): samplers.PastTrialsSampler shows them to
the sampler only, as the study's first trials. Every process that opens the study (created, resumed, a worker
joining) reads them once, unless warm start is off for it.
"""
from __future__ import annotations

import json
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from latentsweep.search.redact import redact_url
from latentsweep.search.study.contract import ENQUEUED_ATTR, IDENTITY_ATTR, WARM_ATTR, read_side
from latentsweep.search.study.samplers import DEFAULT, LEARNS_FROM_PAST, PastTrialsSampler
from latentsweep.search.study.space import Param, config_key
from latentsweep.search.study.storage import StorageSettings, dispose, open_storage, storage_of
from latentsweep.search.study.studyfile import StudyFile
from latentsweep.search.stores import read_only_storage
from latentsweep.trainers.config.tree import coerce, flatten
from latentsweep.trainers.data.sets import fingerprint
from latentsweep.trainers.core.errors import LatentsweepError
from latentsweep.trainers.core.progress import say

# At most this many configurations are taken: SageMaker's warm start takes at most 5 parent jobs, and full.toml
# finishes about 27 trials in 5 minutes on 2 quiet cores (docs/results.md), so a 60-s `run` searches a handful.
WARM_K = 5
PORTFOLIO = Path(__file__).with_name("portfolio.toml")
SPLIT_KEYS = ("data.split", "data.val_ratio", "data.salt", "data.n_folds", "data.fold")
# The default when neither --no-warm-start nor the API's warm_start says: on unless this is off/0/false/no (a test
# suite or a benchmark whose studies share a state directory and data, and must not feed each other).
WARM_ENV = "LATENTSWEEP_WARM_START"


def on_by_default() -> bool:
    return os.environ.get(WARM_ENV, "on").strip().lower() not in ("off", "0", "false", "no")


@dataclass
class Changes:
    """What translating configurations into the new space changed, said once per kind of change."""
    dropped: set[str] = field(default_factory=set)  # knobs the new space lacks
    clipped: set[str] = field(default_factory=set)  # values moved into the new range
    skipped: set[str] = field(default_factory=set)  # a categorical value not among the new choices: config skipped
    new: set[str] = field(default_factory=set)  # knobs new to this space: left to the sampler

    def lines(self) -> list[str]:
        said = [(self.dropped, "dropped (not in this study's space)"),
                (self.clipped, "clipped into this study's range"),
                (self.skipped, "outside this study's choices (their configurations skipped)"),
                (self.new, "new in this study (left to the sampler)")]
        return [f"warm start: {len(keys)} knob(s) {what}: {', '.join(sorted(keys))}" for keys, what in said if keys]


def identity(study_file: StudyFile, data_path: str) -> dict[str, Any]:
    """What makes two studies' values comparable: the train file's fingerprint, the objective and its direction,
    and the validation split (recorded; only the first three decide what a study warm-starts from)."""
    base = flatten(study_file.base)
    return {"fingerprint": fingerprint(data_path), "objective": study_file.objective,
            "direction": study_file.direction, **{k: str(base.get(k)) for k in SPLIT_KEYS}}


def same_objective(mine: dict, theirs: Any) -> bool:
    return isinstance(theirs, dict) and all(theirs.get(k) == mine[k] for k in ("fingerprint", "objective",
                                                                                 "direction"))


@dataclass(frozen=True)
class Found:
    """A COMPLETE trial of an earlier study on the same data and objective."""
    label: str  # where: "study 'NAME'" (and " in SOURCE" for a --warm-from)
    study: str
    trial: optuna.trial.FrozenTrial
    same_split: bool  # its value is comparable with this study's: the sampler may learn from it


def source_storages(warm_from: tuple[str, ...]) -> list[tuple[str, str]]:
    """(label, Optuna storage URL) of each --warm-from: a URL as given, a state directory's optuna.db read-only."""
    out = []
    for source in warm_from:
        if "://" in source:
            out.append((redact_url(source), source))
        else:
            root = Path(source).expanduser().resolve()
            try:
                out.append((str(root), read_only_storage(root)))
            except LatentsweepError:
                raise LatentsweepError(f"--warm-from {source}: neither a state directory holding optuna.db nor an "
                                       f"Optuna storage URL") from None
    return out


def earlier_trials(storage, mine: dict, exclude: str, where: str) -> list[Found]:
    """The finished trials of every study in `storage` on the same data and objective, except study `exclude` (the
    new study itself): COMPLETE ones with a value, and PRUNED ones with an intermediate value (what TPE ranks a
    pruned trial by: most of a short or loaded study's trials are pruned). Side trials (no parameters) are left
    out."""
    found = []
    for summary in optuna.get_all_study_summaries(storage, include_best_trial=False):
        theirs = summary.user_attrs.get(IDENTITY_ATTR)
        if summary.study_name == exclude or not same_objective(mine, theirs):
            continue
        label = f"study '{summary.study_name}'" + (f" in {where}" if where else "")
        same_split = all(theirs.get(k) == mine.get(k) for k in SPLIT_KEYS)
        study_id = storage.get_study_id_from_name(summary.study_name)
        trials = storage.get_all_trials(study_id, deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
        found += [Found(label, summary.study_name, t, same_split) for t in trials
                  if (t.value is not None or t.state == TrialState.PRUNED and t.intermediate_values)
                  and t.params and read_side(t, summary.study_name) is None]
    return found


def find_earlier(study: optuna.Study, mine: dict, warm_from: tuple[str, ...]) -> list[Found]:
    """The earlier trials of the study's own storage, then of each --warm-from source."""
    found = earlier_trials(storage_of(study), mine, study.study_name, "")
    for label, url in source_storages(warm_from):
        storage = open_storage(StorageSettings(url))
        try:
            found += earlier_trials(storage, mine, study.study_name if url == storage_of(study).url else "", label)
        finally:
            dispose(storage)
    return found


def translate(params: dict[str, Any], space: tuple[Param, ...], base_values: dict[str, Any],
              changes: Changes) -> dict[str, Any] | None:
    """{Optuna parameter: value} of `params` (an earlier trial's parameters) in `space`, in sampling order; None when
    a categorical value is not among the new choices. Out-of-range numbers are clipped (and put on the step)."""
    by_key: dict[str, Any] = {}
    for name, value in params.items():
        by_key.setdefault(config_key(name), value)  # a branch renamed in the new space: the knob is the same
    changes.dropped |= {config_key(n) for n in params} - {p.key for p in space}
    current, out = dict(base_values), {}
    for p in space:
        if not p.active(current):
            continue
        value = params.get(p.name, by_key.get(p.key))
        if value is None:  # a knob the earlier study did not search: not fixed, so the sampler proposes it
            changes.new.add(p.key)
            continue
        if p.type == "categorical" or not isinstance(value, (int, float)) or isinstance(value, bool):
            if value not in (p.choices or ()):  # also a knob that was categorical and is a range now
                changes.skipped.add(p.key)
                return None
        else:
            fitted = fit_range(p, value)
            if fitted != value:
                changes.clipped.add(p.key)
            value = fitted
        out[p.name] = value
        current[p.key] = coerce(p.key, value)
    return out


def fit_range(p: Param, value: float) -> float | int:
    """`value` clipped into [low, high] and onto the parameter's step grid (ints rounded)."""
    value = min(max(float(value), p.low), p.high)
    if p.step:
        value = p.low + round((value - p.low) / p.step) * p.step
        value = min(value, p.high)
    if p.type == "int":
        return int(round(value))
    return value


def ranked(found: list[Found], direction: str) -> list[Found]:
    """Best first in `direction`; ties by source and trial number (a stable order)."""
    sign = -1.0 if direction == "maximize" else 1.0
    return sorted(found, key=lambda f: (sign * f.trial.value, f.label, f.trial.number))


def past_trials(found: list[Found], study_file: StudyFile, changes: Changes) -> list[optuna.trial.FrozenTrial]:
    """The earlier trials on the same split as trials of this study's space (translated as for the queue, with its
    distributions; COMPLETE with their value, PRUNED with their intermediate values), oldest first as a study's own
    trials come (TPE weighs its older trials less), each once (a source found in the storage and again through
    --warm-from)."""
    space, base = {p.name: p for p in study_file.space}, flatten(study_file.base)
    out, seen = [], set()
    for f in sorted((f for f in found if f.same_split),
                    key=lambda f: (f.trial.datetime_complete is None, f.trial.datetime_complete or 0, f.label,
                                   f.trial.number)):
        values = translate(f.trial.params, study_file.space, base, changes)
        key = (f.study, f.trial.number, f.trial.value, json.dumps(values, sort_keys=True, default=str))
        if not values or key in seen:
            continue
        seen.add(key)
        try:
            out.append(optuna.trial.create_trial(
                state=f.trial.state, params=values, distributions={name: space[name].distribution() for name in values},
                value=f.trial.value, intermediate_values=dict(f.trial.intermediate_values),
                user_attrs={WARM_ATTR: f"{f.study}:{f.trial.number}"}))
        except ValueError:  # a translated value its distribution does not hold (off a float step by rounding)
            continue
    return out


def learn(study: optuna.Study, study_file: StudyFile, past: list[optuna.trial.FrozenTrial]) -> int | None:
    """Make the study's sampler learn from `past` (PastTrialsSampler); how many trials, None when its sampler is
    not one that learns from past trials."""
    if study_file.sampler.get("name", DEFAULT["sampler"]) not in LEARNS_FROM_PAST:
        return None
    if past:
        study.sampler = PastTrialsSampler(study.sampler, past)
    return len(past)


def learned_text(study_file: StudyFile, learned: int | None, of: str) -> str:
    if learned is None:
        return f"sampler '{study_file.sampler.get('name')}' does not learn from earlier trials"
    return f"the sampler learns from {learned} finished trial(s) of {of} on the same validation split"


def portfolio() -> list[dict[str, Any]]:
    """The bundled portfolio's configurations ({Optuna parameter of studies/full.toml: value}), best first."""
    if not PORTFOLIO.is_file():
        return []
    with PORTFOLIO.open("rb") as fh:
        tables = tomllib.load(fh).get("config", [])
    return [{k: v for k, v in t.items() if k not in ("source", "value")} for t in tables]


def enqueue(study: optuna.Study, values: dict[str, Any], source: str) -> bool:
    """Queue one configuration unless the study has it already (a recipe of the study file); True when queued."""
    before = len(study.get_trials(deepcopy=False))
    study.enqueue_trial(values, user_attrs={ENQUEUED_ATTR: True, WARM_ATTR: source}, skip_if_exists=True)
    return len(study.get_trials(deepcopy=False)) > before


def warm_start(study: optuna.Study, study_file: StudyFile, data_path: str, enabled: bool | None = None,
               warm_from: tuple[str, ...] = (), k: int = WARM_K) -> bool:
    """Record the study's identity, then (when `enabled`; None: WARM_ENV decides, on by default) queue the best
    distinct configurations of earlier studies on the same data and make the sampler learn from their trials,
    saying what it took in one line (and one per kind of change to them). Called before the study file's recipes
    are queued: the earlier studies ran those recipes on this data too and ranked them with the rest, so the best
    known configuration runs first. Returns whether the portfolio is due (enabled, no COMPLETE trial found): it goes
    after the recipes (queue_portfolio)."""
    mine = identity(study_file, data_path)
    study.set_user_attr(IDENTITY_ATTR, mine)
    if not (on_by_default() if enabled is None else enabled):
        return False
    found = find_earlier(study, mine, warm_from)
    if not found:
        return True
    changes, taken, seen = Changes(), {}, set()
    complete = [f for f in found if f.trial.state == TrialState.COMPLETE]
    for f in ranked(complete, study_file.direction):
        values = translate(f.trial.params, study_file.space, flatten(study_file.base), changes)
        text = json.dumps(values, sort_keys=True, default=str)
        if values and text not in seen:
            seen.add(text)
            if enqueue(study, values, f"{f.study}:{f.trial.number}"):
                taken[f.label] = taken.get(f.label, 0) + 1
        if sum(taken.values()) >= k:
            break
    learned = learn(study, study_file, past_trials(found, study_file, changes))
    what = ", ".join(f"{n} from {label}" for label, n in taken.items())
    say(f"warm start: {sum(taken.values())} configuration(s) of earlier studies on the same data "
        f"({mine['fingerprint']}) first: {what or 'none (each one is queued already or none fits this space)'}; "
        f"{learned_text(study_file, learned, 'theirs')}")
    for line in changes.lines():
        say(line)
    return not complete  # only pruned earlier trials: the portfolio is tried instead of theirs


def learn_from_earlier(study: optuna.Study, study_file: StudyFile, data_path: str, enabled: bool | None = None,
                       warm_from: tuple[str, ...] = (), quiet: bool = False) -> None:
    """A study opened again (resumed, or a worker joining it): nothing is queued, but its sampler learns from the
    earlier studies' trials as at creation (read again: a source may have finished more since). One line unless
    `quiet` (a joining worker: the process that created or resumed the study said it)."""
    if not (on_by_default() if enabled is None else enabled):
        return
    mine = identity(study_file, data_path)  # this run's data and split (a sha256 of the train file: fast)
    found = find_earlier(study, mine, warm_from)
    if not found:
        return
    learned = learn(study, study_file, past_trials(found, study_file, Changes()))
    if not quiet:
        say(f"warm start: {learned_text(study_file, learned, 'earlier studies')} and data ({mine['fingerprint']})")


def queue_portfolio(study: optuna.Study, study_file: StudyFile) -> None:
    """The first study on new data: queue the bundled portfolio's configurations (after the study file's recipes)."""
    changes, seen, queued = Changes(), set(), 0
    for i, params in enumerate(portfolio()):
        values = translate(params, study_file.space, flatten(study_file.base), changes)
        text = json.dumps(values, sort_keys=True, default=str)
        if values and text not in seen:
            seen.add(text)
            queued += enqueue(study, values, f"portfolio:{i}")
    say(f"warm start: no earlier study on this data ({study.user_attrs[IDENTITY_ATTR]['fingerprint']}); "
        f"{queued} configuration(s) of the bundled portfolio queued after the study file's recipes")
    for line in changes.lines():
        say(line)


def warm_tags(trial) -> dict[str, str]:
    """The MLflow tag of a warm-started trial (its source), {} for any other."""
    source = trial.user_attrs.get(WARM_ATTR)
    return {WARM_ATTR: str(source)} if source else {}


def warm_sources(study: optuna.Study) -> dict[int, str]:
    """{trial number: source} of the study's warm-started trials ("NAME:TRIAL" or "portfolio:INDEX")."""
    found = {t.number: t.user_attrs.get(WARM_ATTR) for t in study.get_trials(deepcopy=False)}
    return {number: str(source) for number, source in found.items() if source}


def warm_column(study: optuna.Study, frame) -> list[str]:
    """`study status`: add the `warm_from` column (each trial's source) when any trial was warm-started."""
    sources = warm_sources(study)
    if not sources:
        return []
    frame["warm_from"] = frame["number"].map(sources)
    return ["warm_from"]


__all__ = ["IDENTITY_ATTR", "WARM_ATTR", "WARM_K", "identity", "learn_from_earlier", "portfolio", "queue_portfolio",
           "translate", "warm_column", "warm_sources", "warm_start", "warm_tags"]
