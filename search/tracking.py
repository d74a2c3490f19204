"""Experiment tracking behind a small interface: MLflow via MlflowClient only (no fluent run state), or in memory."""
from __future__ import annotations

import hashlib
import logging
import os
import re
import time
import uuid
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from trainers.errors import ConfigError, LatentsweepError

log = logging.getLogger(__name__)

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
# Optional settings key: when given, ensure_study reuses only a parent run carrying the same uid, so a deleted and
# re-created Optuna study of the same name gets a fresh parent instead of mixing trials of both.
UID_SETTING = "study_uid"
PLOTS_DIR = "plots"
# Optuna state -> MLflow status; INTERRUPTED (Ctrl-C / SIGTERM) is ours: the trial is FAIL in Optuna and retried.
STATUS_OF_STATE = {"COMPLETE": "FINISHED", "PRUNED": "KILLED", "INTERRUPTED": "KILLED"}  # anything else -> FAILED
_DB_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")


@runtime_checkable
class Tracker(Protocol):
    """What the study layer needs from a tracking backend (see CONTRACTS.md, Tracking)."""

    def ensure_study(self, study_name: str, settings: dict[str, Any]) -> str: ...
    def attach_study(self, study_name: str, parent_run_id: str) -> None: ...
    def start_trial(self, number: int, params: dict[str, Any], tags: dict[str, Any]) -> str: ...
    def log_epoch(self, run_id: str, metrics: dict[str, float], step: int) -> None: ...
    def set_tags(self, run_id: str, tags: dict[str, Any]) -> None: ...
    def log_artifacts(self, run_id: str, paths: list[Path], artifact_path: str | None = None) -> None: ...
    def log_figure(self, run_id: str, figure: Any, name: str) -> None: ...
    def end_trial(self, run_id: str, state: Any) -> None: ...
    def end_study(self, summary: dict[str, Any], figures: dict[str, Any]) -> None: ...
    def find_trial_run(self, number: int) -> str | None: ...
    def close_stale_runs(self, alive_numbers: set[int]) -> list[str]: ...


# ---------------------------------------------------------------- helpers shared by both trackers

# scheme://[user]:password@host -> the password runs to the last '@' that is followed by a host (no '@', no '/'),
# so an unencoded '@' or '/' inside a password is still hidden.
_URL_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.\-]*://[^:/@\s]*):(?P<pw>\S*)@(?=[^@/\s]*(?:[/?#\s]|$))")
_SECRET_KEYS = {"password", "passwd", "secret", "token", "api_key", "apikey", "access_key", "secret_key", "private_key"}
_SECRET_SUFFIXES = tuple(f"_{k}" for k in _SECRET_KEYS - {"token"})  # db_password yes, n_token (a size) no
_BAD_KEY_CHARS = re.compile(r"[^/\w.\- :]")  # MLflow accepts only these in param/metric/tag names


def redact_url(url: str) -> str:
    """Replace every URL password in `url` by *** (postgresql://u:pw@h/db -> postgresql://u:***@h/db)."""
    return _URL_PASSWORD.sub(lambda m: f"{m['head']}:***@" if m["pw"] else m[0], url)


def redact_values(values: dict[str, Any]) -> dict[str, Any]:
    """Copy of `values` with URL passwords hidden in string values and secret-named keys (password, db_password,
    token, …) masked."""
    out = {}
    for key, value in values.items():
        leaf = re.split(r"[./]", str(key))[-1].lower()
        if (leaf in _SECRET_KEYS or leaf.endswith(_SECRET_SUFFIXES)) and value not in (None, ""):
            out[key] = "***"
        else:
            out[key] = redact_url(value) if isinstance(value, str) else value
    return out


def _flat(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _clean_key(key: str) -> str:
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


def _clean_items(values: dict[str, Any], value_limit: int) -> dict[str, str]:
    """Flatten, stringify, redact, and make keys/values fit MLflow; keys that collide after cleaning get a hash."""
    out: dict[str, str] = {}
    for key, value in redact_values({k: str(v) for k, v in _flat(values).items()}).items():
        clean = _clean_key(key)
        if clean in out:
            clean = _clean_key(f"{clean[:KEY_MAX - 9]}~{hashlib.sha1(key.encode()).hexdigest()[:8]}")
        out[clean] = _clip(value, value_limit)
    return out


def _clean_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    return {_clean_key(k): float(v) for k, v in metrics.items() if v is not None}


def _status_of(state: Any) -> tuple[str, str]:
    """(Optuna state name, MLflow run status) of an Optuna TrialState or its name."""
    name = str(getattr(state, "name", state)).split(".")[-1].upper()
    return name, STATUS_OF_STATE.get(name, "FAILED")


def _trial_tags(number: int, study: str, parent: str, tags: dict[str, Any]) -> tuple[dict[str, str], dict[str, str]]:
    """(nesting tags, cleaned user tags); a user tag never overrides a nesting tag."""
    base = {PARENT_TAG: parent, ROLE_TAG: "trial", TRIAL_TAG: str(number), STUDY_TAG: study}
    user = {k: v for k, v in _clean_items(tags, TAG_VALUE_MAX).items() if k not in base}
    return base, user


def _parent_tags(study: str, settings: dict[str, Any]) -> dict[str, str]:
    tags = {ROLE_TAG: "parent", STUDY_TAG: study}
    if settings.get(UID_SETTING) not in (None, ""):
        tags[UID_TAG] = _uid(settings[UID_SETTING])
    return tags


def _uid(value: Any) -> str:
    """A uid safe to quote in an MLflow filter string."""
    text = str(value)
    return text if re.fullmatch(r"[\w.\-:]{1,64}", text) else hashlib.sha1(text.encode()).hexdigest()[:16]


def _split_settings(existing: dict[str, str], settings: dict[str, Any]) -> tuple[dict[str, str], dict[str, str]]:
    """(new params, tags): params are immutable in MLflow, so a setting that changed since creation becomes a tag."""
    params, tags = {}, {}
    for key, value in _clean_items(settings, PARAM_VALUE_MAX).items():
        if key not in existing:
            params[key] = value
        elif existing[key] != value:
            tags[_clean_key(f"setting.{key}")] = value
    return params, tags


def _summary_entries(summary: dict[str, Any]) -> tuple[dict[str, float], dict[str, str]]:
    """Numbers -> metrics; best_params -> tags best.<key>; anything else -> tags summary.<key> (tags can change)."""
    metrics, tags = {}, {}
    for key, value in summary.items():
        if key == "best_params":
            tags.update(_clean_items({f"best.{k}": v for k, v in (value or {}).items()}, TAG_VALUE_MAX))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            metrics[_clean_key(key)] = float(value)
        elif value is not None:
            tags.update(_clean_items({f"summary.{key}": value}, TAG_VALUE_MAX))
    return metrics, tags


def _close_figure(figure: Any) -> None:
    """Release a matplotlib figure (pyplot keeps every open figure alive); other figure types need nothing."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return
    if isinstance(figure, Figure):
        import matplotlib.pyplot as plt

        plt.close(figure)


def study_summary(study: Any) -> dict[str, Any]:
    """Summary of an Optuna study for end_study: trial counts by state, best value/trial/params (single objective)."""
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    summary: dict[str, Any] = {
        f"trials_{name}": sum(t.state == state for t in trials)
        for name, state in (("complete", TrialState.COMPLETE), ("pruned", TrialState.PRUNED),
                            ("failed", TrialState.FAIL), ("running", TrialState.RUNNING))
    }
    summary["trials_total"] = len(trials)
    if summary["trials_complete"] and len(study.directions) == 1:
        best = study.best_trial
        summary.update(best_value=best.value, best_trial=best.number, best_params=dict(best.params))
    elif summary["trials_complete"]:
        summary["pareto_front_size"] = len(study.best_trials)
    return summary


def default_artifact_root(tracking_uri: str) -> str | None:
    """Artifact root for a tracking URI: <db dir>/artifacts for a SQLite file, None (server decides) otherwise."""
    if tracking_uri.startswith("sqlite:///"):
        db = tracking_uri[len("sqlite:///"):].split("?")[0]
        return (Path(db).expanduser().resolve().parent / "artifacts").as_uri()
    return None


def _artifact_location(root: str, experiment: str) -> str:
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", experiment).strip("._") or "study"
    if "://" in root or root.startswith("file:"):
        return f"{root.rstrip('/')}/{name}"
    return (Path(root).expanduser().resolve() / name).as_uri()


def _quiet_mlflow_logs() -> None:
    """Hide per-migration INFO lines of MLflow's first SQLite use, unless the user configured these loggers, and the
    two "View run … at: URL" lines the REST client writes to stdout on every set_terminated (unless set already)."""
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    for name in ("mlflow.store.db.utils", "alembic.runtime.migration", "alembic"):
        logger = logging.getLogger(name)
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.WARNING)


def _transient_errors() -> tuple[type[BaseException], ...]:
    from mlflow.exceptions import MlflowException

    errors: list[type[BaseException]] = [MlflowException, OSError]
    try:
        import requests

        errors.append(requests.exceptions.RequestException)
    except ImportError:
        pass
    try:
        import sqlalchemy.exc

        errors.append(sqlalchemy.exc.SQLAlchemyError)
    except ImportError:
        pass
    return tuple(errors)


def _chunks(items: list, size: int):
    for start in range(0, len(items), size):
        yield items[start:start + size]


def _now_ms() -> int:
    return int(time.time() * 1000)


# ---------------------------------------------------------------- MLflow


class MlflowTracker:
    """Tracker on an MLflow tracking URI (sqlite:///…, postgresql://…, http(s)://…) through MlflowClient only."""

    def __init__(self, tracking_uri: str, artifact_root: str | None = None):
        from mlflow import MlflowClient
        from mlflow.exceptions import MlflowException

        _quiet_mlflow_logs()
        self.tracking_uri = tracking_uri
        self.artifact_root = artifact_root if artifact_root is not None else default_artifact_root(tracking_uri)
        try:
            self.client = MlflowClient(tracking_uri=tracking_uri)
        except (MlflowException, ImportError) as exc:
            # SQLAlchemy 2.1 maps postgresql:// to psycopg 3; the project ships psycopg2 (postgresql+psycopg2://)
            reason = (str(exc).splitlines() or [type(exc).__name__])[0]
            raise ConfigError(f"MLflow tracking URI {redact_url(tracking_uri)}: {reason}") from None
        self.study_name: str | None = None
        self.experiment_id: str | None = None
        self.parent_run_id: str | None = None
        self._warned = False

    # ----- study / parent run

    def ensure_study(self, study_name: str, settings: dict[str, Any]) -> str:
        """Get-or-create the experiment and the parent run `study-<name>`; the oldest parent wins a race."""
        self._bind_experiment(study_name, create=True)
        tags = _parent_tags(study_name, settings)
        parent = self._find_parent(tags.get(UID_TAG))
        if parent is None:
            created = self.client.create_run(self.experiment_id, run_name=f"study-{study_name}", tags=tags).info.run_id
            parent = self._find_parent(tags.get(UID_TAG))
            if parent != created:  # another worker created one first: keep theirs
                self.client.delete_run(created)
        self.parent_run_id = parent
        existing = self.client.get_run(parent).data.params
        params, changed = _split_settings(existing, settings)
        self._log_batch(parent, params=params, tags=changed)
        self.client.update_run(parent, status="RUNNING")
        return parent

    def attach_study(self, study_name: str, parent_run_id: str) -> None:
        from mlflow.exceptions import MlflowException

        self._bind_experiment(study_name, create=False)
        try:
            info = self.client.get_run(parent_run_id).info
        except MlflowException:
            info = None
        if info is None or info.experiment_id != self.experiment_id or info.lifecycle_stage != "active":
            raise LatentsweepError(f"MLflow parent run {parent_run_id} of study '{study_name}' not found in "
                                   f"{redact_url(self.tracking_uri)}")
        self.parent_run_id = parent_run_id
        self.client.update_run(parent_run_id, status="RUNNING")

    def end_study(self, summary: dict[str, Any], figures: dict[str, Any]) -> None:
        """Refresh the parent's summary metrics/tags and plots, then mark it FINISHED."""
        from mlflow.entities import Metric

        parent = self._require_study()
        try:
            metrics, tags = _summary_entries(summary)
            step, now = int(summary.get("trials_total", 0)), _now_ms()
            self._log_batch(parent, metrics=[Metric(k, v, now, step) for k, v in metrics.items()], tags=tags)
            stale = [k for k in self.client.get_run(parent).data.tags if k.startswith("best.") and k not in tags]
            for key in stale:  # best params of an earlier best trial with other (conditional) params
                self.client.delete_tag(parent, key)
            for name, figure in figures.items():
                self.log_figure(parent, figure, f"{PLOTS_DIR}/{name}")
        finally:
            for figure in figures.values():
                _close_figure(figure)
        self.client.set_terminated(parent, status="FINISHED")

    # ----- trials

    def start_trial(self, number: int, params: dict[str, Any], tags: dict[str, Any]) -> str:
        parent = self._require_study()
        base, user = _trial_tags(number, self.study_name, parent, tags)
        run_id = self.client.create_run(self.experiment_id, run_name=f"trial-{number}", tags=base).info.run_id
        self._log_batch(run_id, params=_clean_items(params, PARAM_VALUE_MAX), tags=user)
        return run_id

    def log_epoch(self, run_id: str, metrics: dict[str, float], step: int) -> None:
        """Log one epoch's metrics; a tracking outage is warned about once and never ends the trial."""
        from mlflow.entities import Metric

        now = _now_ms()
        batch = [Metric(k, v, now, int(step)) for k, v in _clean_metrics(metrics).items()]
        try:
            self._log_batch(run_id, metrics=batch)
        except _transient_errors() as exc:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            if not self._warned:
                self._warned = True
                log.warning("MLflow logging failed (%s); training continues, later failures are not reported",
                            redact_url(first))
            else:
                log.debug("MLflow logging failed again: %s", redact_url(first))

    def set_tags(self, run_id: str, tags: dict[str, Any]) -> None:
        self._log_batch(run_id, tags=_clean_items(tags, TAG_VALUE_MAX))

    def log_artifacts(self, run_id: str, paths: list[Path], artifact_path: str | None = None) -> None:
        """Files go under artifact_path; a directory goes under artifact_path/<its name>."""
        for path in map(Path, paths):
            if path.is_dir():
                sub = f"{artifact_path}/{path.name}" if artifact_path else path.name
                self.client.log_artifacts(run_id, str(path), sub)
            elif path.is_file():
                self.client.log_artifact(run_id, str(path), artifact_path)
            else:
                raise LatentsweepError(f"artifact {path} does not exist")

    def log_figure(self, run_id: str, figure: Any, name: str) -> None:
        try:
            self.client.log_figure(run_id, figure, name)
        finally:
            _close_figure(figure)

    def end_trial(self, run_id: str, state: Any) -> None:
        name, status = _status_of(state)
        self.client.set_tag(run_id, STATE_TAG, name)
        self.client.set_terminated(run_id, status=status)

    # ----- reaper support

    def find_trial_run(self, number: int) -> str | None:
        self._require_study()
        runs = self.client.search_runs(
            [self.experiment_id], f"tags.`{ROLE_TAG}` = 'trial' and tags.`{TRIAL_TAG}` = '{int(number)}'",
            max_results=1, order_by=["attributes.start_time DESC"])
        return runs[0].info.run_id if runs else None

    def close_stale_runs(self, alive_numbers: set[int]) -> list[str]:
        """Mark FAILED (tag latentsweep.reaped=true) every RUNNING trial run whose trial is not alive."""
        self._require_study()
        closed = []
        for run in self._search(f"tags.`{ROLE_TAG}` = 'trial' and attributes.status = 'RUNNING'"):
            number = run.data.tags.get(TRIAL_TAG, "")
            if number.lstrip("-").isdigit() and int(number) in alive_numbers:
                continue
            self.client.set_tag(run.info.run_id, REAPED_TAG, "true")
            self.client.set_terminated(run.info.run_id, status="FAILED")
            closed.append(run.info.run_id)
        return closed

    # ----- internals

    def _bind_experiment(self, name: str, create: bool) -> None:
        from mlflow.exceptions import MlflowException

        exp = self.client.get_experiment_by_name(name)
        if exp is None and not create:
            raise LatentsweepError(f"MLflow experiment '{name}' not found in {redact_url(self.tracking_uri)}")
        if exp is None:
            try:
                self.experiment_id = self.client.create_experiment(name, artifact_location=self._location(name))
            except MlflowException as exc:
                if exc.error_code != "RESOURCE_ALREADY_EXISTS":  # else another worker created it just now
                    raise
                self.experiment_id = self.client.get_experiment_by_name(name).experiment_id
        else:
            if exp.lifecycle_stage == "deleted":
                self.client.restore_experiment(exp.experiment_id)
            self.experiment_id = exp.experiment_id
        self.study_name = name

    def _location(self, name: str) -> str | None:
        if self.artifact_root is not None:
            return _artifact_location(self.artifact_root, name)
        if self.tracking_uri.split(":", 1)[0].split("+")[0] in _DB_SCHEMES:
            # MLflow would default to ./mlruns of whichever process creates the experiment
            raise ConfigError(f"MLflow tracking URI {redact_url(self.tracking_uri)} is a database: "
                              "an artifact root is required")
        return None

    def _find_parent(self, uid: str | None) -> str | None:
        filt = f"tags.`{ROLE_TAG}` = 'parent'" + (f" and tags.`{UID_TAG}` = '{uid}'" if uid else "")
        runs = self._search(filt)
        if not runs:
            return None
        return min(runs, key=lambda r: (r.info.start_time, r.info.run_id)).info.run_id

    def _search(self, filter_string: str) -> list:
        runs, token = [], None
        while True:
            page = self.client.search_runs([self.experiment_id], filter_string, max_results=1000, page_token=token)
            runs.extend(page)
            token = page.token
            if not token:
                return runs

    def _require_study(self) -> str:
        if self.parent_run_id is None:
            raise LatentsweepError("tracker has no study: call ensure_study or attach_study first")
        return self.parent_run_id

    def _log_batch(self, run_id: str, params: dict[str, str] | None = None, tags: dict[str, str] | None = None,
                   metrics: list | None = None) -> None:
        """log_batch split to MLflow's per-request limits (100 params, 100 tags, 1000 metrics)."""
        from mlflow.entities import Param, RunTag

        for chunk in _chunks([Param(k, v) for k, v in (params or {}).items()], PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(run_id, params=chunk, synchronous=True)
        for chunk in _chunks([RunTag(k, v) for k, v in (tags or {}).items()], PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(run_id, tags=chunk, synchronous=True)
        for chunk in _chunks(list(metrics or []), METRICS_PER_BATCH):
            self.client.log_batch(run_id, metrics=chunk, synchronous=True)


# ---------------------------------------------------------------- in memory


class InMemoryTracker:
    """Tracker that records runs as dicts (name, params, tags, metrics {key: [(step, value)]}, artifacts, status)."""

    def __init__(self) -> None:
        self.runs: dict[str, dict[str, Any]] = {}
        self.study_name: str | None = None
        self.parent_run_id: str | None = None

    def _new_run(self, name: str, tags: dict[str, str]) -> str:
        run_id = uuid.uuid4().hex
        self.runs[run_id] = {"name": name, "params": {}, "tags": dict(tags), "metrics": {}, "artifacts": [],
                             "status": "RUNNING", "order": len(self.runs)}
        return run_id

    def _require_study(self) -> str:
        if self.parent_run_id is None:
            raise LatentsweepError("tracker has no study: call ensure_study or attach_study first")
        return self.parent_run_id

    def ensure_study(self, study_name: str, settings: dict[str, Any]) -> str:
        tags = _parent_tags(study_name, settings)
        parents = [rid for rid, run in self.runs.items() if run["tags"].get(ROLE_TAG) == "parent"
                   and run["tags"].get(STUDY_TAG) == study_name
                   and (UID_TAG not in tags or run["tags"].get(UID_TAG) == tags[UID_TAG])]
        parent = parents[0] if parents else self._new_run(f"study-{study_name}", tags)
        params, changed = _split_settings(self.runs[parent]["params"], settings)
        self.runs[parent]["params"].update(params)
        self.runs[parent]["tags"].update(changed)
        self.runs[parent]["status"] = "RUNNING"
        self.study_name, self.parent_run_id = study_name, parent
        return parent

    def attach_study(self, study_name: str, parent_run_id: str) -> None:
        run = self.runs.get(parent_run_id)
        if run is None or run["tags"].get(STUDY_TAG) != study_name:
            raise LatentsweepError(f"parent run {parent_run_id} of study '{study_name}' not found")
        run["status"] = "RUNNING"
        self.study_name, self.parent_run_id = study_name, parent_run_id

    def start_trial(self, number: int, params: dict[str, Any], tags: dict[str, Any]) -> str:
        base, user = _trial_tags(number, self.study_name, self._require_study(), tags)
        run_id = self._new_run(f"trial-{number}", {**base, **user})
        self.runs[run_id]["params"].update(_clean_items(params, PARAM_VALUE_MAX))
        return run_id

    def log_epoch(self, run_id: str, metrics: dict[str, float], step: int) -> None:
        for key, value in _clean_metrics(metrics).items():
            self.runs[run_id]["metrics"].setdefault(key, []).append((int(step), value))

    def set_tags(self, run_id: str, tags: dict[str, Any]) -> None:
        self.runs[run_id]["tags"].update(_clean_items(tags, TAG_VALUE_MAX))

    def log_artifacts(self, run_id: str, paths: list[Path], artifact_path: str | None = None) -> None:
        prefix = f"{artifact_path}/" if artifact_path else ""
        for path in map(Path, paths):
            if path.is_dir():
                files = sorted(f.relative_to(path).as_posix() for f in path.rglob("*") if f.is_file())
                names = [f"{prefix}{path.name}/{name}" for name in files]
            elif path.is_file():
                names = [f"{prefix}{path.name}"]
            else:
                raise LatentsweepError(f"artifact {path} does not exist")
            self.runs[run_id]["artifacts"].extend(names)

    def log_figure(self, run_id: str, figure: Any, name: str) -> None:
        self.runs[run_id]["artifacts"].append(name)
        _close_figure(figure)

    def end_trial(self, run_id: str, state: Any) -> None:
        name, status = _status_of(state)
        self.runs[run_id]["tags"][STATE_TAG] = name
        self.runs[run_id]["status"] = status

    def end_study(self, summary: dict[str, Any], figures: dict[str, Any]) -> None:
        parent = self.runs[self._require_study()]
        metrics, tags = _summary_entries(summary)
        step = int(summary.get("trials_total", 0))
        for key, value in metrics.items():
            parent["metrics"].setdefault(key, []).append((step, value))
        parent["tags"] = {k: v for k, v in parent["tags"].items() if not k.startswith("best.")} | tags
        for name, figure in figures.items():
            self.log_figure(self.parent_run_id, figure, f"{PLOTS_DIR}/{name}")
        parent["status"] = "FINISHED"

    def trial_runs(self) -> list[str]:
        """Run ids of this study's trial runs, oldest first."""
        return [rid for rid, run in self.runs.items()
                if run["tags"].get(ROLE_TAG) == "trial" and run["tags"].get(PARENT_TAG) == self.parent_run_id]

    def find_trial_run(self, number: int) -> str | None:
        self._require_study()
        found = [rid for rid in self.trial_runs() if self.runs[rid]["tags"][TRIAL_TAG] == str(int(number))]
        return found[-1] if found else None

    def close_stale_runs(self, alive_numbers: set[int]) -> list[str]:
        self._require_study()
        closed = []
        for rid in self.trial_runs():
            run = self.runs[rid]
            if run["status"] == "RUNNING" and int(run["tags"][TRIAL_TAG]) not in alive_numbers:
                run["status"] = "FAILED"
                run["tags"][REAPED_TAG] = "true"
                closed.append(rid)
        return closed


def make_tracker(uri: str, artifact_root: str | None = None) -> Tracker:
    """Tracker for a URI: 'memory' gives an InMemoryTracker, anything else an MlflowTracker."""
    if uri in ("memory", "memory:", "memory://"):
        return InMemoryTracker()
    return MlflowTracker(uri, artifact_root)
