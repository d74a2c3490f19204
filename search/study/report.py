"""Reports of studies: a study's trials table (Optuna's trials_dataframe), header line and summary, and the table of a
storage's studies; used by `study status|list|run`, the parent run and the picker."""
from __future__ import annotations

from typing import Any

import optuna
import pandas as pd
from optuna.trial import TrialState

from latentsweep.search.redact import redact_url
from latentsweep.search.study.contract import DEVICE_ATTR, POPULATION_ATTR, StudyRecord, read_side
from latentsweep.search.study.storage import StorageSettings, dispose, open_storage
from latentsweep.search.study.warm import warm_column, warm_sources
from latentsweep.search.tracking.base import SUMMARY_STEP_KEY
from latentsweep.trainers.core.errors import LatentsweepError

FIXED = ["number", "state", "value", "duration_s"]


def load_existing_study(name: str, storage, heartbeat: int | None = None, grace: int | None = None) -> optuna.Study:
    """Load a study by name with a one-line error naming the known studies when it does not exist. `storage` is a
    URL; heartbeat/grace (seconds) set the storage's stale-trial rule for a reaper."""
    settings = StorageSettings(storage)
    if heartbeat is not None and grace is not None:
        settings = StorageSettings(storage, heartbeat, grace)
    optuna_storage = open_storage(settings)
    try:
        return optuna.load_study(study_name=name, storage=optuna_storage)
    except KeyError:
        known = [s.study_name for s in optuna.get_all_study_summaries(optuna_storage)]
        raise LatentsweepError(
            f"no study named '{name}' in {redact_url(storage)}; known: {', '.join(known) or 'none'}"
        ) from None


def study_table(study: optuna.Study, varying_only: bool = True) -> pd.DataFrame:
    """number, state, value, duration (s), the device each trial trained on (when recorded), then the searched knobs
    (only those that vary when varying_only); complete trials first, best first, then the others by number."""
    frame = study.trials_dataframe(attrs=("number", "state", "value", "duration", "params"))
    if frame.empty:
        return pd.DataFrame(columns=FIXED)
    value = next(c for c in frame.columns if c == "value" or c.startswith("value_"))  # value_<metric name>
    frame = frame.rename(columns={value: "value", **{c: c[len("params_"):] for c in frame.columns
                                                       if c.startswith("params_")}})
    for trial in study.get_trials(deepcopy=False):  # a side trial's knob values stand in its row's cells
        for key, val in (read_side(trial, study.study_name) or {}).items():
            if key in frame.columns:
                frame.loc[frame["number"] == trial.number, key] = val
    frame["value"] = pd.to_numeric(frame["value"])  # all None (no trial has a value yet) would be an object column
    # all None (only waiting trials) is an object column: converted, it is NaT, printed empty
    frame["duration_s"] = pd.to_timedelta(frame.pop("duration")).dt.total_seconds().round(1)
    fixed = FIXED + _devices(study, frame) + warm_column(study, frame)
    knobs = [c for c in frame.columns if c not in fixed]
    if varying_only:
        knobs = [c for c in knobs if frame[c].astype(str).nunique(dropna=False) > 1]
    frame = frame[fixed + knobs]
    maximize = study.direction == optuna.study.StudyDirection.MAXIMIZE
    order = frame.assign(_done=frame["state"] != "COMPLETE",
                         _key=-frame["value"] if maximize else frame["value"])
    order = order.sort_values(["_done", "_key", "number"], na_position="last")
    return frame.loc[order.index].reset_index(drop=True)


def _devices(study: optuna.Study, frame: pd.DataFrame) -> list[str]:
    """Add the `device` column (latentsweep.search.study.contract.DEVICE_ATTR of each trial) when any trial recorded
    one, and the
    `population` column (its size, POPULATION_ATTR) when any trained in one; their names in a list, or none (a study
    from before devices were recorded)."""
    devices = {t.number: t.user_attrs.get(DEVICE_ATTR) for t in study.get_trials(deepcopy=False)}
    if not any(devices.values()):
        return []
    frame["device"] = frame["number"].map(devices)
    sizes = {t.number: (t.user_attrs.get(POPULATION_ATTR) or {}).get("size") for t in study.get_trials(deepcopy=False)}
    if not any(sizes.values()):  # every trial trained alone (latentsweep.search.study.population): no column
        return ["device"]
    frame["population"] = frame["number"].map(sizes)
    return ["device", "population"]


def study_summary(study: optuna.Study) -> dict[str, Any]:
    """Trials by state (trials_complete, trials_pruned, trials_fail, trials_running, trials_waiting), how many there
    are and how many finished (complete, pruned or failed), the best trial when one completed (single objective;
    a multi-objective study gives the size of its Pareto front) and the warm-started trials' sources when any. The
    CLI prints it; the parent run logs it with the finished count as the step (the sources as a tag)."""
    trials = study.get_trials(deepcopy=False)
    summary: dict[str, Any] = {f"trials_{s.name.lower()}": sum(t.state == s for t in trials) for s in TrialState}
    summary["trials_total"] = len(trials)
    summary[SUMMARY_STEP_KEY] = sum(t.state.is_finished() for t in trials)
    if summary["trials_complete"] and len(study.directions) == 1:
        best = study.best_trial
        # a side trial samples nothing: its knob values stand where a sampled trial's parameters would
        summary.update(best_value=best.value, best_trial=best.number,
                       best_params=dict(best.params) or read_side(best, study.study_name) or {})
    elif summary["trials_complete"]:
        summary["pareto_front_size"] = len(study.best_trials)
    sources = warm_sources(study)
    if sources:  # the parent run's tag summary.warm_from: where the warm-started trials came from
        summary["warm_from"] = ", ".join(f"trial {n} <- {source}" for n, source in sorted(sources.items()))
    return summary


def study_header(study: optuna.Study) -> str:
    """`study NAME: maximize val/mrr, N trials (c complete, p pruned, f failed, r running), best V (trial K)`."""
    trials = study.get_trials(deepcopy=False)
    counts = pd.Series([t.state.name.lower() for t in trials], dtype=object).value_counts().to_dict()
    parts = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    metric = StudyRecord.of(study).objective or "objective"
    header = f"study {study.study_name}: {study.direction.name.lower()} {metric}, {len(trials)} trials"
    header += f" ({parts})" if parts else ""
    try:
        best = study.best_trial
        header += f", best {best.value:.4f} (trial {best.number})"
    except ValueError:
        header += ", no complete trial yet"
    return header


def studies_table(storage: str) -> pd.DataFrame:
    """One row per study in `storage`: name, direction, objective, trials by state, best value and trial."""
    optuna_storage = open_storage(StorageSettings(storage))
    rows = []
    try:
        for s in optuna.get_all_study_summaries(optuna_storage, include_best_trial=True):
            study = optuna.load_study(study_name=s.study_name, storage=optuna_storage)
            states = pd.Series([t.state.name.lower() for t in study.get_trials(deepcopy=False)],
                               dtype=object).value_counts()
            best = s.best_trial
            rows.append({"study": s.study_name, "direction": s.direction.name.lower(),
                         "objective": StudyRecord.of(study).objective or "",
                         "trials": s.n_trials, **{k: int(states.get(k, 0)) for k in ("complete", "pruned", "fail",
                                                                                       "running")},
                         "best_value": None if best is None else best.value,
                         "best_trial": None if best is None else best.number,
                         "created": s.datetime_start})
    finally:
        dispose(optuna_storage)
    return pd.DataFrame(rows, columns=["study", "direction", "objective", "trials", "complete", "pruned", "fail",
                                       "running", "best_value", "best_trial", "created"])
