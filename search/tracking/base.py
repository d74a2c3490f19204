"""Experiment tracking behind a small interface: MLflow via MlflowClient only (no fluent run state), or in memory."""
from __future__ import annotations

import hashlib
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, runtime_checkable

from latentsweep.search.redact import redact_values
from latentsweep.search.tracking.source import source_tags
from latentsweep.trainers.config.tree import flatten_tree


# MLflow 3.x limits (mlflow/utils/validation.py: MAX_ENTITY_KEY_LENGTH, MAX_PARAM_VAL_LENGTH, MAX_TAG_VAL_LENGTH,
# MAX_PARAMS_TAGS_PER_BATCH, MAX_METRICS_PER_BATCH).
KEY_MAX = 250
PARAM_VALUE_MAX = 6000
TAG_VALUE_MAX = 8000
PARAMS_TAGS_PER_BATCH = 100
METRICS_PER_BATCH = 1000

ROLE_TAG = "latentsweep.role"
STUDY_TAG = "latentsweep.study"
UID_TAG = "latentsweep.study_uid"
REAPED_TAG = "latentsweep.reaped"
TRIAL_TAG = "optuna.trial_number"
STATE_TAG = "optuna.state"
PARENT_TAG = "mlflow.parentRunId"
# MLflow's own tag name (mlflow/utils/mlflow_tags.py), so its UI fills the Description field.
NOTE_TAG = "mlflow.note.content"
SEARCHED_TAG = "latentsweep.searched"  # comma-separated knobs the study samples (the rest of the params is the base)
SEARCH_PARAM_PREFIX = "search."  # sampled values are also params search.<knob>, apart from the resolved config
OBJECTIVE_TAG = "latentsweep.objective"
# MLflow 3 opens an experiment without this tag as a GenAI app (traces, "Evaluations", "Agent versions").
EXPERIMENT_TAGS = {"mlflow.experimentKind": "custom_model_development"}
PRIMARY_METRIC_TAG = "mlflow.experiment.primaryMetric.name"
PRIMARY_GREATER_TAG = "mlflow.experiment.primaryMetric.greaterIsBetter"
BEST_EPOCH_METRIC = "best_epoch"
# The study summary's count of finished trials (complete, pruned, failed): the step of the parent run's summary
# metrics, so their history shows how the study progressed.
SUMMARY_STEP_KEY = "trials_finished"
DESCRIPTION_SETTING = "description"  # a setting shown as the run's and experiment's description, not a param
SEARCHED_SETTING = "searched"  # comma-separated knobs the study samples (a param): the trials view's knob columns
# Trial tags the trials view shows as columns (the warm-start source): presentation, not a param.
VIEW_TAGS_SETTING = "view_tags"
# MLflow 3's shared views: an experiment tag mlflow.sharedViewState.<key> holds a runs page's state as JSON (columns,
# sort, filter), opened by the URL parameter viewStateShareKey=<key> (the experiment page's shared-view hook in
# mlflow/server/js). MLflow's default runs table shows no metric, param or tag column; this view shows the trials
# with their objective, state, searched knobs and the view_tags, best first.
SHARED_VIEW_PREFIX = "mlflow.sharedViewState."
TRIALS_VIEW = "trials"
# Optional settings key: when given, ensure_study reuses only a parent run carrying the same uid, so a deleted and
# re-created Optuna study of the same name gets a fresh parent instead of mixing trials of both.
UID_SETTING = "study_uid"
PLOTS_DIR = "plots"
# Optuna state -> MLflow status. A pruned trial ended as designed (as in Optuna's own MLflowCallback): FINISHED with
# tag optuna.state=PRUNED, so MLflow's red mark is left to failures; INTERRUPTED (Ctrl-C / SIGTERM) is ours: the
# trial is FAIL in Optuna and retried.
STATUS_OF_STATE = {"COMPLETE": "FINISHED", "PRUNED": "FINISHED", "INTERRUPTED": "KILLED"}  # anything else -> FAILED
DB_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")


@runtime_checkable
class Tracker(Protocol):
    """What studies and picks need from a tracking backend (docs/tracking.md says what is logged where)."""

    # a study: its experiment and parent run, opened by the first worker, re-opened by the others and on resume,
    # summarised at the end; the reaper closes the runs of trials no worker runs any more
    def ensure_study(self, study_name: str, settings: dict[str, Any]) -> str: ...
    def attach_study(self, study_name: str, parent_run_id: str, reopen: bool = True) -> None: ...
    def end_study(self, summary: dict[str, Any], figures: dict[str, Any]) -> None: ...  # step: SUMMARY_STEP_KEY
    def close_stale_runs(self, alive_numbers: set[int]) -> list[str]: ...
    # a trial: its run nested under the parent, then what every run logs, then its end with the Optuna state
    def start_trial(self, number: int, params: dict[str, Any], tags: dict[str, Any]) -> str: ...
    def log(self, run_id: str, *, metrics: dict[str, float] | None = None, step: int = 0,
            params: dict[str, Any] | None = None, tags: dict[str, Any] | None = None) -> None: ...
    def log_dataset(self, run_id: str, dataset: DatasetRecord) -> None: ...
    def log_artifacts(self, run_id: str, paths: list[Path], artifact_path: str | None = None) -> None: ...
    def log_figure(self, run_id: str, figure: Any, name: str) -> None: ...
    def end_trial(self, run_id: str, state: Any) -> None: ...
    # a pick: a run in the study's experiment (under the parent when it is in the same store), logged with `log`,
    # ended with an MLflow status; the trials' checkpoints it reads and the pyfunc model it logs
    def open_experiment(self, study_name: str) -> str: ...
    def has_run(self, run_id: str) -> bool: ...
    def start_run(self, run_name: str, tags: dict[str, Any]) -> str: ...
    def end_run(self, run_id: str, status: str = "FINISHED") -> None: ...
    def download_artifact(self, run_id: str, path: str, directory: Path) -> Path: ...
    def log_model(self, run_id: str, spec: ModelSpec, register: str | None = None) -> LoggedModel: ...


# ---------------------------------------------------------------- helpers shared by both trackers

_BAD_KEY_CHARS = re.compile(r"[^/\w.\- :]")  # MLflow accepts only these in param/metric/tag names


def clean_key(key: str) -> str:
    """A valid, path-unique MLflow key: bad characters -> '_', no empty/'.'/'..' segments, at most KEY_MAX chars."""
    parts = [p for p in _BAD_KEY_CHARS.sub("_", str(key)).split("/") if p not in ("", ".")]
    clean = "/".join("__" if p == ".." else p for p in parts) or "_"
    if len(clean) > KEY_MAX:
        clean = f"{clean[:KEY_MAX - 9]}~{hashlib.sha1(str(key).encode()).hexdigest()[:8]}"
    return clean


def _clip(value: str, limit: int) -> str:
    if len(value) <= limit:
        return value
    note = f"...[truncated: {len(value)} chars]"
    return value[: limit - len(note)] + note


def clean_items(values: dict[str, Any], value_limit: int) -> dict[str, str]:
    """Flatten, stringify, redact, and make keys/values fit MLflow; keys that collide after cleaning get a hash."""
    out: dict[str, str] = {}
    for key, value in redact_values({k: str(v) for k, v in flatten_tree(values).items()}).items():
        clean = clean_key(key)
        if clean in out:
            clean = clean_key(f"{clean[:KEY_MAX - 9]}~{hashlib.sha1(key.encode()).hexdigest()[:8]}")
        out[clean] = _clip(value, value_limit)
    return out


def clean_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    return {clean_key(k): float(v) for k, v in metrics.items() if v is not None}


def status_of(state: Any) -> tuple[str, str]:
    """(Optuna state name, MLflow run status) of an Optuna TrialState or its name."""
    name = str(getattr(state, "name", state)).split(".")[-1].upper()
    return name, STATUS_OF_STATE.get(name, "FAILED")


def trial_tags(number: int, study: str, parent: str, tags: dict[str, Any]) -> tuple[dict[str, str], dict[str, str]]:
    """(nesting tags, cleaned user tags); a user tag never overrides a nesting tag."""
    base = {PARENT_TAG: parent, ROLE_TAG: "trial", TRIAL_TAG: str(number), STUDY_TAG: study}
    user = {k: v for k, v in clean_items(tags, TAG_VALUE_MAX).items() if k not in base}
    return base, user


def parent_tags(study: str, settings: dict[str, Any]) -> dict[str, str]:
    tags = {ROLE_TAG: "parent", STUDY_TAG: study, **source_tags(f"latentsweep study {study}")}
    if settings.get(DESCRIPTION_SETTING):
        tags[NOTE_TAG] = _clip(str(settings[DESCRIPTION_SETTING]), TAG_VALUE_MAX)
    if settings.get("objective"):
        tags[OBJECTIVE_TAG] = str(settings["objective"])
    if settings.get(UID_SETTING) not in (None, ""):
        tags[UID_TAG] = _uid(settings[UID_SETTING])
    return tags


def _uid(value: Any) -> str:
    """A uid safe to quote in an MLflow filter string."""
    text = str(value)
    return text if re.fullmatch(r"[\w.\-:]{1,64}", text) else hashlib.sha1(text.encode()).hexdigest()[:16]


def split_settings(existing: dict[str, str], settings: dict[str, Any]) -> tuple[dict[str, str], dict[str, str]]:
    """(new params, tags): params are immutable in MLflow, so a setting that changed since creation becomes a tag."""
    params, tags = {}, {}
    settings = {k: v for k, v in settings.items() if k not in (DESCRIPTION_SETTING, VIEW_TAGS_SETTING)}
    for key, value in clean_items(settings, PARAM_VALUE_MAX).items():
        if key not in existing:
            params[key] = value
        elif existing[key] != value:
            tags[clean_key(f"setting.{key}")] = value
    return params, tags


def experiment_tags(settings: dict[str, Any]) -> dict[str, str]:
    """Tags of a study's experiment: the experiment kind, its description and primary metric (the objective)."""
    tags = dict(EXPERIMENT_TAGS)
    if settings.get(DESCRIPTION_SETTING):
        tags[NOTE_TAG] = _clip(str(settings[DESCRIPTION_SETTING]), TAG_VALUE_MAX)
    if settings.get("objective"):
        tags[PRIMARY_METRIC_TAG] = best_metric(str(settings["objective"]))
        tags[PRIMARY_GREATER_TAG] = str(settings.get("direction", "maximize") == "maximize").lower()
        tags[SHARED_VIEW_PREFIX + TRIALS_VIEW] = trials_view(settings)
    return tags


def trials_view(settings: dict[str, Any]) -> str:
    """The trials view's state (JSON): trial runs only, best first by the objective's best epoch, with columns for
    it, the Optuna state, each searched knob (search.<knob>) and the view_tags; knob columns past what one tag holds
    are left out (the rest of the view stays valid JSON)."""
    metric = clean_key(best_metric(str(settings["objective"])))
    knobs = [k for k in str(settings.get(SEARCHED_SETTING) or "").split(",") if k]
    tags = [STATE_TAG, *(settings.get(VIEW_TAGS_SETTING) or ())]
    view = {"searchFilter": f"tags.`{ROLE_TAG}` = 'trial'", "orderByKey": f"metrics.`{metric}`",
            "orderByAsc": settings.get("direction", "maximize") != "maximize"}
    columns = [f"metrics.`{metric}`", *(f"tags.`{clean_key(t)}`" for t in tags),
               *(f"params.`{clean_key(SEARCH_PARAM_PREFIX + k)}`" for k in knobs)]
    while len(json.dumps({**view, "selectedColumns": columns})) > TAG_VALUE_MAX:
        columns.pop()
    return json.dumps({**view, "selectedColumns": columns})


def best_metric(objective: str) -> str:
    """Metric key of a trial's objective value, the best epoch's (what Optuna records): best/val/mrr."""
    return f"best/{objective}"


@dataclass(frozen=True)
class DatasetRecord:
    """A dataset input of a run, as mlflow.log_input records it (its Datasets column)."""
    name: str
    digest: str
    source: str  # a path or URI
    context: str = "train"  # MLflow's mlflow.data.context tag: train / validation / test
    profile: dict[str, Any] | None = None


@dataclass(frozen=True)
class ModelSpec:
    """A models-from-code pyfunc model: its code file, a function that writes its artifacts into a directory and
    returns them as {key: path}, its output width, and what is shown with it."""
    name: str
    code: Path
    stage: Callable[[Path], dict[str, str]]
    output_dim: int  # the output is float32 [N, output_dim]
    model_type: str
    requirements: tuple[str, ...] = ()  # pip requirements besides the tracking library itself
    metadata: dict[str, Any] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)  # linked to the model and its source run
    description: str | None = None
    registry_description: str = ""  # of the registered model, when `register` creates it


@dataclass(frozen=True)
class LoggedModel:
    model_id: str
    model_uri: str  # models:/<model_id>
    registered_name: str | None = None
    registered_version: str | None = None


def summary_entries(summary: dict[str, Any]) -> tuple[dict[str, float], dict[str, str]]:
    """Numbers -> metrics; best_params -> tags best.<key>; anything else -> tags summary.<key> (tags can change)."""
    metrics, tags = {}, {}
    for key, value in summary.items():
        if key == "best_params":
            tags.update(clean_items({f"best.{k}": v for k, v in (value or {}).items()}, TAG_VALUE_MAX))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            metrics[clean_key(key)] = float(value)
        elif value is not None:
            tags.update(clean_items({f"summary.{key}": value}, TAG_VALUE_MAX))
    return metrics, tags


def close_figure(figure: Any) -> None:
    """Release a figure pyplot keeps alive (Optuna's plots); other figures need nothing. Without pyplot imported no
    figure can be registered with it, so it is not imported here."""
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is not None and isinstance(figure, pyplot.Figure):
        pyplot.close(figure)
