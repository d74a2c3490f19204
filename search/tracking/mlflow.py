"""The MLflow tracker: studies, trial runs, epochs, artifacts and reaping through MlflowClient only."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from search.tracking.base import (
    PARAM_VALUE_MAX,
    TAG_VALUE_MAX,
    PARAMS_TAGS_PER_BATCH,
    METRICS_PER_BATCH,
    ROLE_TAG,
    UID_TAG,
    REAPED_TAG,
    TRIAL_TAG,
    STATE_TAG,
    PLOTS_DIR,
    _DB_SCHEMES,
    redact_url,
    _clean_items,
    _clean_metrics,
    _status_of,
    _trial_tags,
    _parent_tags,
    _split_settings,
    _summary_entries,
    _close_figure,
    default_artifact_root,
    _artifact_location,
    _quiet_mlflow_logs,
    _transient_errors,
    _chunks,
    _now_ms,
    DatasetRecord,
    EXPERIMENT_TAGS,
    experiment_tags,
    log,
)
from trainers.errors import ConfigError, LatentsweepError


def dataset_input(dataset: DatasetRecord):
    """The DatasetInput mlflow.log_input would log for a local file (source type `local`, digest <= 36 chars)."""
    import json

    from mlflow.entities import Dataset, DatasetInput, InputTag

    entity = Dataset(name=dataset.name, digest=dataset.digest[:36], source_type="local",
                     source=json.dumps({"uri": dataset.source}), schema="", profile=json.dumps(dataset.profile or {}))
    return DatasetInput(entity, [InputTag("mlflow.data.context", dataset.context)])


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
        self._bind_experiment(study_name, create=True, tags=experiment_tags(settings))
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

    def attach_study(self, study_name: str, parent_run_id: str, reopen: bool = True) -> None:
        """Bind to the study's parent run; `reopen`: mark it RUNNING again (a run resumes; `study reap` does not)."""
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
        if reopen:
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

    def log_dataset(self, run_id: str, dataset: DatasetRecord) -> None:
        """mlflow.log_input through the client: the run's Datasets column (name, digest, context)."""
        self.client.log_inputs(run_id, [dataset_input(dataset)])

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
            self.client.set_tag(run.info.run_id, STATE_TAG, "FAIL")  # its trial was failed by the heartbeat
            self.client.set_terminated(run.info.run_id, status="FAILED")
            closed.append(run.info.run_id)
        return closed

    # ----- internals

    def _bind_experiment(self, name: str, create: bool, tags: dict[str, str] | None = None) -> None:
        """Find (or create) the study's experiment and make sure it carries `tags` (default: its kind only)."""
        from mlflow.exceptions import MlflowException

        tags = tags or dict(EXPERIMENT_TAGS)
        exp = self.client.get_experiment_by_name(name)
        if exp is None and not create:
            raise LatentsweepError(f"MLflow experiment '{name}' not found in {redact_url(self.tracking_uri)}")
        if exp is None:
            try:
                self.experiment_id = self.client.create_experiment(name, artifact_location=self._location(name),
                                                                   tags=tags)
            except MlflowException as exc:
                if exc.error_code != "RESOURCE_ALREADY_EXISTS":  # else another worker created it just now
                    raise
                self.experiment_id = self.client.get_experiment_by_name(name).experiment_id
        else:
            if exp.lifecycle_stage == "deleted":
                self.client.restore_experiment(exp.experiment_id)
            self.experiment_id = exp.experiment_id
            for key, value in tags.items():  # experiments made before these tags existed get them too
                if exp.tags.get(key) != value:
                    self.client.set_experiment_tag(exp.experiment_id, key, value)
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
