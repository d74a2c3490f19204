"""The search-to-pick contract: every attribute key a study and its trials store (one home each) and the typed readers
through which the pick, the one-budget job, the budget and the reaper read them; a damaged value is one line naming
the study and the trial, never a KeyError or TypeError.

Stored as Optuna user attrs under the names studies have always used, so a study written before this module existed
reads the same. Writers (search/study/objective.py, side.py, worker.py, warm.py, owners.py) import the keys from here.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any, Mapping

import optuna
from optuna.study import StudyDirection

from latentsweep.search.study.storage import storage_of
from latentsweep.trainers.train.cost import Timing
from latentsweep.trainers.core.errors import LatentsweepError
from latentsweep.trainers.core.progress import say

# ---- study attributes --------------------------------------------------------------------------------------------
OBJECTIVE_ATTR = "objective"  # the study file's objective metric (Optuna's metric_names say the same when set)
PARENT_ATTR = "mlflow_parent_run_id"  # the study's MLflow parent run: trials and picks nest under it
HALT_ATTR = "latentsweep.halted"  # set when a bug stopped a worker: the others stop before claiming their next trial
PLUGINS_ATTR = "latentsweep.plugins"  # {file name: sha256} of the study's plugin files
# {fingerprint, objective, direction, split...} (latentsweep.search.study.warm.identity)
IDENTITY_ATTR = "latentsweep.data"
# Study attr (the recipes are queued) and trial attr (this trial was queued, not sampled).
ENQUEUED_ATTR = "latentsweep.enqueued"

# ---- trial attributes (besides TrialOutputs' fields) -------------------------------------------------------------
# the run's measured seconds (latentsweep.trainers.train.cost.Timing as a dict): the pick's plan, the budget
TIMING_ATTR = "timing"
SIDE_ATTR = "latentsweep.side"  # JSON {config key: value} of a side trial (latentsweep.search.study.side)
ERROR_ATTR = "latentsweep.error"  # set on trials that failed for good (not retried; they count in the budget)
DEADLINE_ATTR = "latentsweep.stopped_at_deadline"  # on a trial the deadline cut short: where it stopped
OWNER_ATTR = "latentsweep.worker"  # "host:pid" of the worker running the trial (latentsweep.search.study.owners)
DEVICE_ATTR = "latentsweep.device"  # the device the trial trained on (also its MLflow tag)
POPULATION_ATTR = "latentsweep.population"  # {id, size} of the population it trained in (also its MLflow tag)
# A one-budget job's answer in place as its keeper last judged it: {"source", "val_mrr"} (the leaderboard MRR of the
# study's val split, latentsweep.search.pick.judge); the search's reserve keeps refits only for trials that beat it.
ANSWER_ATTR = "latentsweep.answer_in_place"
# ANSWER_ATTR's map of trial number (a string: JSON keys) -> seconds the keeper took to load that trial's checkpoint
# and score it on the val split, which is what the pick pays per candidate (latentsweep.search.study.budget)
JUDGED_KEY = "judged_s"
WARM_ATTR = "latentsweep.warm_from"  # "NAME:TRIAL" (source study) or "portfolio:INDEX" (also its MLflow tag)


class DamagedStudy(LatentsweepError):
    """A stored value that cannot be read at all (not JSON: a row edited by hand, or damaged): one line naming the
    study and the trial. A value of the wrong type is read as absent instead, said once (the pick goes on without
    it)."""


def _warn_once(line: str) -> None:
    """Say a damaged value once per sink: the budget and the keeper re-read the study at every epoch and poll."""
    say(f"latentsweep: warning: {line}", once=line)


def _where(study: str | None, trial: int | None) -> str:
    return " ".join(filter(None, (f"study '{study}'" if study else "", f"trial {trial}" if trial is not None else "")))


def _typed(value, kind: type):
    return value if isinstance(value, kind) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class TrialOutputs:
    """What one trial left behind. The run and the folder are recorded when the trial starts (a pruned or failed
    trial has them); the checkpoint and best epoch when it completes. Paths are relative to the state directory (or
    absolute when outside it), so a moved state directory still finds them."""
    mlflow_run_id: str | None = None  # the trial's MLflow run (absent when its worker died before opening it)
    out_dir: str | None = None  # its trial-N folder: config.toml, metrics.csv and the best epoch's best.pt
    checkpoint: str | None = None  # best.pt of a complete trial
    best_epoch: int | None = None  # the epoch whose checkpoint best.pt holds (complete trials)

    def as_attrs(self) -> dict:
        """The fields that are set, as JSON-able user attrs."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    @classmethod
    def from_attrs(cls, attrs: Mapping, where: str = "") -> "TrialOutputs":
        """The outputs recorded in a trial's user attrs; a mistyped value reads as None, warned about once naming
        `where` (the study and trial) when given: another attribute, or a study written by hand, cannot break it."""
        values = {}
        for name, kind in KINDS.items():
            values[name] = _typed(attrs.get(name), kind)
            if values[name] is None and attrs.get(name) is not None and where:
                _warn_once(f"{where}: its {name} ({str(attrs[name])[:40]!r}) is not a {kind.__name__}; read as "
                           "absent")
        return cls(**values)

    @classmethod
    def of(cls, trial, study: str | None = None) -> "TrialOutputs":
        """The outputs of an Optuna trial (FrozenTrial or a live Trial) of the study named `study`."""
        return cls.from_attrs(trial.user_attrs, _where(study or _study_name(trial), trial.number))

    def record(self, trial) -> None:
        """Write the fields that are set on a live Optuna trial (the others stay as they were)."""
        for name, value in self.as_attrs().items():
            trial.set_user_attr(name, value)

    @property
    def local_checkpoint(self) -> str | None:
        """Where the trial's best.pt is on disk: the completed trial's checkpoint, else its folder's best.pt (a
        pruned trial records no checkpoint, but kept its best epoch's); None when neither was recorded."""
        return self.checkpoint or (f"{self.out_dir}/best.pt" if self.out_dir else None)


KINDS = {"mlflow_run_id": str, "out_dir": str, "checkpoint": str, "best_epoch": int}


def _study_name(trial) -> str | None:
    """A live trial knows its study; a FrozenTrial does not."""
    study = getattr(trial, "study", None)
    return getattr(study, "study_name", None)


def read_timing(trial, study: str | None = None) -> Timing | None:
    """The trial's measured seconds (TIMING_ATTR), None when it recorded none; a value that is not a Timing reads as
    None, warned about once naming the study and trial."""
    stored = trial.user_attrs.get(TIMING_ATTR)
    timing = Timing.from_attrs(stored)
    if stored is not None and timing is None:
        _warn_once(f"{_where(study or _study_name(trial), trial.number)}: its timing ({TIMING_ATTR}) is not a "
                   "measured Timing; read as unmeasured")
    return timing


def read_side(trial, study: str | None = None) -> dict[str, Any] | None:
    """A side trial's knob values (SIDE_ATTR: a JSON object), or None for a trial the sampler proposed or an enqueued
    recipe; a value that is not a JSON object reads as None (the trial as a sampled one), warned about once."""
    text = trial.user_attrs.get(SIDE_ATTR)
    if text is None:
        return None
    try:
        values = json.loads(text) if isinstance(text, str) else None
    except ValueError:
        values = None
    if not isinstance(values, dict):
        _warn_once(f"{_where(study or _study_name(trial), trial.number)}: its side values ({SIDE_ATTR}) are not a "
                   "JSON object; read as a sampled trial")
        return None
    return values


@dataclass(frozen=True)
class TrialRecord:
    """Everything the pick reads of one trial's attributes: what it left (TrialOutputs), its measured seconds and a
    side trial's knob values; each None when absent or of the wrong type (said once, naming the study and trial)."""
    number: int
    outputs: TrialOutputs
    timing: Timing | None
    side: Mapping[str, Any] | None

    @classmethod
    def of(cls, trial, study: str | None = None) -> "TrialRecord":
        name = study or _study_name(trial)
        return cls(trial.number, TrialOutputs.of(trial, name), read_timing(trial, name), read_side(trial, name))


@dataclass(frozen=True)
class StudyRecord:
    """What the pick and the one-budget job read of the study itself: its name, objective metric and direction, its
    MLflow parent run (None when absent or damaged: a pick's run then stands alone) and the job's answer in place."""
    name: str
    objective: str | None
    maximize: bool
    parent_run_id: str | None
    answer: Mapping[str, Any] | None = None  # a one-budget job's answer in place (ANSWER_ATTR), None when absent

    @classmethod
    def of(cls, study: optuna.Study) -> "StudyRecord":
        """Read once (see study_attrs)."""
        attrs = study_attrs(study)
        objective = (study.metric_names or [None])[0] or _checked(attrs, OBJECTIVE_ATTR, str, study.study_name)
        return cls(study.study_name, objective, study.direction == StudyDirection.MAXIMIZE,
                   _checked(attrs, PARENT_ATTR, str, study.study_name),
                   _checked(attrs, ANSWER_ATTR, dict, study.study_name))


def study_attrs(study: optuna.Study) -> dict[str, Any]:
    """The study's own attributes; one that is not JSON (a row of the storage written by hand) makes Optuna's reader
    raise: here it is a DamagedStudy naming the study."""
    try:
        return study.user_attrs
    except ValueError as exc:  # json.JSONDecodeError
        raise DamagedStudy(f"study '{study.study_name}': an attribute of the study is not JSON ({exc}); the study's "
                           "storage was edited or damaged") from None


def _checked(attrs: Mapping, key: str, kind: type, study: str):
    value = attrs.get(key)
    if value is not None and _typed(value, kind) is None:
        _warn_once(f"study '{study}': its {key} ({str(value)[:40]!r}) is not a {kind.__name__}; read as absent")
        return None
    return value


def read_trials(study: optuna.Study, states=None) -> list[optuna.trial.FrozenTrial]:
    """The study's trials (`states` as Optuna's get_trials), not copied. A trial attribute that is not JSON (a row
    written by hand) makes Optuna's reader raise for the whole study: here it is a DamagedStudy naming the trial."""
    try:
        return study.get_trials(deepcopy=False, states=states)
    except ValueError as exc:  # json.JSONDecodeError
        where = _where(study.study_name, _damaged_trial(study))
        raise DamagedStudy(f"{where}: an attribute is not JSON ({exc}); the study's storage was edited or damaged: "
                           "repair or delete that trial") from None


def _damaged_trial(study: optuna.Study) -> int | None:
    """The number of the first trial whose stored attributes cannot be read, trial by trial (None: not found)."""
    storage = storage_of(study)
    study_id = storage.get_study_id_from_name(study.study_name)
    number = 0
    while True:
        try:
            trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, number)
        except KeyError:
            return None
        try:
            storage.get_trial(trial_id)
        except ValueError:
            return number
        number += 1


__all__ = ["DamagedStudy", "StudyRecord", "TrialOutputs", "TrialRecord", "read_side", "read_timing", "read_trials",
           "study_attrs"]
