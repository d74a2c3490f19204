"""The MLflow tracker, the only module of search/ that talks to MLflow: studies, trial runs, epochs, artifacts, reaping,
and the runs and pyfunc models of `latentsweep pick`, all through MlflowClient (no fluent run state)."""
from __future__ import annotations

import json
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import mlflow
import mlflow.pyfunc
import numpy as np
from mlflow import MlflowClient
from mlflow.entities import Dataset, DatasetInput, InputTag, LoggedModelOutput, Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.models import Model, ModelSignature
from mlflow.types import Schema, TensorSpec
from sqlparse.lexer import Lexer

from latentsweep.search.tracking.base import (
    DB_SCHEMES,
    EXPERIMENT_TAGS,
    METRICS_PER_BATCH,
    NOTE_TAG,
    PARAM_VALUE_MAX,
    PARAMS_TAGS_PER_BATCH,
    PLOTS_DIR,
    REAPED_TAG,
    ROLE_TAG,
    STATE_TAG,
    SUMMARY_STEP_KEY,
    TAG_VALUE_MAX,
    TRIAL_TAG,
    UID_TAG,
    DatasetRecord,
    LoggedModel,
    ModelSpec,
    clean_items,
    clean_metrics,
    close_figure,
    experiment_tags,
    parent_tags,
    split_settings,
    status_of,
    summary_entries,
    trial_tags,
)
from latentsweep.search.process import stops_deferred
from latentsweep.search.redact import redact_url
from latentsweep.search.tracking.paths import artifact_location, default_artifact_root
from latentsweep.search.tracking.schema import seed_store
from latentsweep.trainers.core.errors import ConfigError, LatentsweepError

# MLflow parses every search filter with sqlparse, whose one lexer is built at its first use. A stop signal (our
# handlers raise KeyboardInterrupt) arriving while it is built leaves it without its rules, and every later filter
# of that process then fails as "Invalid clause(s) in filter string: 't', 'a', 'g', ..." (seen closing the runs of a
# worker stopped by SIGTERM 0.3 s into a trial). Built here, before this module's first filter, a stop signal
# deferred until it is whole.
with stops_deferred():
    Lexer.get_default_instance()


def dataset_input(dataset: DatasetRecord) -> DatasetInput:
    """The DatasetInput mlflow.log_input would log for a local file (source type `local`, digest <= 36 chars)."""
    entity = Dataset(name=dataset.name, digest=dataset.digest[:36], source_type="local",
                     source=json.dumps({"uri": dataset.source}), schema="", profile=json.dumps(dataset.profile or {}))
    return DatasetInput(entity, [InputTag("mlflow.data.context", dataset.context)])


def _now_ms() -> int:
    return int(time.time() * 1000)


class MlflowTracker:
    """Tracker on an MLflow tracking URI (sqlite:///…, postgresql://…, http(s)://…) through MlflowClient only."""

    def __init__(self, tracking_uri: str, artifact_root: str | None = None):
        self.tracking_uri = tracking_uri
        self.artifact_root = artifact_root if artifact_root is not None else default_artifact_root(tracking_uri)
        seed_store(tracking_uri)  # a new SQLite store: a copy of a migrated one (latentsweep.search.tracking.schema)
        try:
            self.client = MlflowClient(tracking_uri=tracking_uri)
        except (MlflowException, ImportError) as exc:
            # SQLAlchemy 2.1 maps postgresql:// to psycopg 3; the project ships psycopg2 (postgresql+psycopg2://)
            reason = (str(exc).splitlines() or [type(exc).__name__])[0]
            raise ConfigError(f"MLflow tracking URI {redact_url(tracking_uri)}: {reason}") from None
        self.study_name: str | None = None
        self.experiment_id: str | None = None
        self.parent_run_id: str | None = None

    # ----- study / parent run

    def ensure_study(self, study_name: str, settings: dict[str, Any]) -> str:
        """Get-or-create the experiment and the parent run `study-<name>`; the oldest parent wins a race."""
        self._bind_experiment(study_name, create=True, tags=experiment_tags(settings))
        tags = parent_tags(study_name, settings)
        parent = self._find_parent(tags.get(UID_TAG))
        if parent is None:
            created = self.client.create_run(self.experiment_id, run_name=f"study-{study_name}", tags=tags).info.run_id
            parent = self._find_parent(tags.get(UID_TAG))
            if parent != created:  # another worker created one first: keep theirs
                self.client.delete_run(created)
        self.parent_run_id = parent
        try:
            self._log_settings(parent, settings)
        except MlflowException:  # a worker started at the same moment logged the same new settings first (an
            self._log_settings(parent, settings)  # IntegrityError, wrapped): theirs stand, the rest is logged now
        self.client.update_run(parent, status="RUNNING")
        return parent

    def attach_study(self, study_name: str, parent_run_id: str, reopen: bool = True) -> None:
        """Bind to the study's parent run; `reopen`: mark it RUNNING again (a run resumes; `study reap` does not)."""
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
        parent = self._require_study()
        try:
            metrics, tags = summary_entries(summary)
            step, now = int(summary.get(SUMMARY_STEP_KEY, 0)), _now_ms()
            self._log_batch(parent, metrics=[Metric(k, v, now, step) for k, v in metrics.items()], tags=tags)
            stale = [k for k in self.client.get_run(parent).data.tags if k.startswith("best.") and k not in tags]
            for key in stale:  # best params of an earlier best trial with other (conditional) params
                self.client.delete_tag(parent, key)
            for name, figure in figures.items():
                self.log_figure(parent, figure, f"{PLOTS_DIR}/{name}")
        finally:  # the run ends whatever failed above (a bug in our own calls included): never left RUNNING
            try:
                for figure in figures.values():
                    close_figure(figure)
            finally:
                self.client.set_terminated(parent, status="FINISHED")

    # ----- trials

    def start_trial(self, number: int, params: dict[str, Any], tags: dict[str, Any]) -> str:
        parent = self._require_study()
        base, user = trial_tags(number, self.study_name, parent, tags)
        run_id = self.client.create_run(self.experiment_id, run_name=f"trial-{number}", tags=base).info.run_id
        try:
            self._log_batch(run_id, params=clean_items(params, PARAM_VALUE_MAX), tags=user)
        except BaseException:  # the caller never learns this run's id (an interrupt, a store error): end it here
            self.client.set_terminated(run_id, status="KILLED")
            raise
        return run_id

    def log(self, run_id: str, *, metrics: dict[str, float] | None = None, step: int = 0,
            params: dict[str, Any] | None = None, tags: dict[str, Any] | None = None) -> None:
        """Metrics at `step`, params and tags in one batched call. What it raises is classified by the caller
        (latentsweep.search.failures): an outage stops the worker in one line and the trial is retried; anything else
        is a bug."""
        now = _now_ms()
        self._log_batch(run_id, params=clean_items(params or {}, PARAM_VALUE_MAX),
                        tags=clean_items(tags or {}, TAG_VALUE_MAX),
                        metrics=[Metric(k, v, now, int(step)) for k, v in clean_metrics(metrics or {}).items()])

    def log_dataset(self, run_id: str, dataset: DatasetRecord) -> None:
        """mlflow.log_input through the client: the run's Datasets column (name, digest, context)."""
        self.client.log_inputs(run_id, [dataset_input(dataset)])

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
            close_figure(figure)

    def end_trial(self, run_id: str, state: Any) -> None:
        name, status = status_of(state)
        try:
            self.client.set_tag(run_id, STATE_TAG, name)
        finally:  # the run ends even when its state tag could not be written
            self.client.set_terminated(run_id, status=status)

    # ----- reaper support

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

    # ----- runs outside the trials (`latentsweep pick`) and models

    def open_experiment(self, study_name: str) -> str:
        """Get-or-create the study's experiment without touching its parent run; returns its id. Without an artifact
        root the tracking server chooses where a new experiment's artifacts go."""
        self._bind_experiment(study_name, create=True, location_required=False)
        return self.experiment_id

    def has_run(self, run_id: str) -> bool:
        """Whether `run_id` is a run of the bound experiment (a study's parent may live in another tracking store)."""
        try:
            return self.client.get_run(run_id).info.experiment_id == self.experiment_id
        except MlflowException:
            return False

    def start_run(self, run_name: str, tags: dict[str, Any]) -> str:
        """A RUNNING run in the bound experiment (nested under another when tags carry mlflow.parentRunId)."""
        return self.client.create_run(self.experiment_id, run_name=run_name,
                                      tags=clean_items(tags, TAG_VALUE_MAX)).info.run_id

    def end_run(self, run_id: str, status: str = "FINISHED") -> None:
        self.client.set_terminated(run_id, status=status)

    def download_artifact(self, run_id: str, path: str, directory: Path) -> Path:
        """Copy the run's artifact `path` into `directory` (created if missing); returns the local file."""
        directory.mkdir(parents=True, exist_ok=True)
        return Path(self.client.download_artifacts(run_id, path, str(directory)))

    def log_model(self, run_id: str, spec: ModelSpec, register: str | None = None) -> LoggedModel:
        """Log `spec` as a pyfunc LoggedModel output of run `run_id`, with its params, metrics (linked to the run)
        and description; the model directory is saved locally with `mlflow.pyfunc.save_model` and uploaded with
        `log_model_artifacts`. Registered under `register` if given. A failure marks the model FAILED."""
        tags = dict(spec.tags)
        if spec.description:
            tags[NOTE_TAG] = spec.description
        model = self.client.create_logged_model(self.experiment_id, name=spec.name, source_run_id=run_id,
                                                model_type=spec.model_type, tags=tags,
                                                params={k: str(v) for k, v in spec.params.items()})
        try:
            with tempfile.TemporaryDirectory(prefix="latentsweep-pyfunc-") as tmp:
                artifacts = spec.stage(Path(tmp) / "staged")
                local = Path(tmp) / "model"
                meta = Model(artifact_path=model.artifact_location, run_id=run_id, model_uuid=model.model_id,
                             model_id=model.model_id)
                signature = ModelSignature(outputs=Schema([TensorSpec(np.dtype(np.float32), (-1, spec.output_dim))]))
                with warnings.catch_warnings():
                    # MLflow suggests type hints and an input example; the model's docstrings and metadata say it.
                    warnings.simplefilter("ignore", UserWarning)
                    mlflow.pyfunc.save_model(str(local), python_model=str(spec.code), artifacts=artifacts,
                                             signature=signature, mlflow_model=meta, metadata=spec.metadata,
                                             pip_requirements=[f"mlflow=={mlflow.__version__}", *spec.requirements])
                    self.client.log_model_artifacts(model.model_id, str(local))
        except BaseException:
            self.client.finalize_logged_model(model.model_id, "FAILED")
            raise
        self.client.finalize_logged_model(model.model_id, "READY")
        for key, value in spec.metrics.items():  # shown on the model's page and in its metrics column
            self.client.log_metric(run_id, key, float(value), step=0, model_id=model.model_id)
        self.client.log_outputs(run_id, [LoggedModelOutput(model.model_id, step=0)])
        uri = f"models:/{model.model_id}"
        if register is None:
            return LoggedModel(model.model_id, uri)
        version = self._register(register, spec.registry_description, model.model_id, model.artifact_location, run_id)
        return LoggedModel(model.model_id, uri, register, version)

    def _register(self, name: str, description: str, model_id: str, source: str, run_id: str) -> str:
        """Create (if needed) the registered model `name` and a new version of the LoggedModel `model_id`.

        source is the LoggedModel's artifact location, not models:/<model_id>: MLflow 3.17's SQL registry store
        resolves a models:/ source through the process-wide tracking URI (its own TODO), which may not be this client's.
        """
        try:
            self.client.create_registered_model(name, description=description)
        except MlflowException as exc:
            if exc.error_code not in ("RESOURCE_ALREADY_EXISTS", "ALREADY_EXISTS"):
                raise
        return str(self.client.create_model_version(name, source=source, run_id=run_id, model_id=model_id).version)

    # ----- internals

    def _bind_experiment(self, name: str, create: bool, tags: dict[str, str] | None = None,
                         location_required: bool = True) -> None:
        """Find (or create) the study's experiment and make sure it carries `tags` (default: its kind only)."""
        tags = tags or dict(EXPERIMENT_TAGS)
        exp = self.client.get_experiment_by_name(name)
        if exp is None and not create:
            raise LatentsweepError(f"MLflow experiment '{name}' not found in {redact_url(self.tracking_uri)}")
        if exp is None:
            try:
                location = self._location(name, location_required)
                self.experiment_id = self.client.create_experiment(name, artifact_location=location, tags=tags)
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

    def _location(self, name: str, required: bool = True) -> str | None:
        if self.artifact_root is not None:
            return artifact_location(self.artifact_root, name)
        if required and self.tracking_uri.split(":", 1)[0].split("+")[0] in DB_SCHEMES:
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

    def _log_settings(self, parent: str, settings: dict[str, Any]) -> None:
        """The study's settings not yet on its parent run: new ones as params, changed ones as tags."""
        params, changed = split_settings(self.client.get_run(parent).data.params, settings)
        self._log_batch(parent, params=params, tags=changed)

    def _log_batch(self, run_id: str, params: dict[str, str] | None = None, tags: dict[str, str] | None = None,
                   metrics: list | None = None) -> None:
        """As few log_batch calls as MLflow's per-request limits allow (100 params, 100 tags, 1000 metrics, 1000
        entities in all): each one a store transaction (issue 33: a trial's start logged its params and its tags in
        two)."""
        param_list = [Param(k, v) for k, v in (params or {}).items()]
        tag_list = [RunTag(k, v) for k, v in (tags or {}).items()]
        metric_list = list(metrics or [])
        while param_list or tag_list or metric_list:
            p, param_list = param_list[:PARAMS_TAGS_PER_BATCH], param_list[PARAMS_TAGS_PER_BATCH:]
            t, tag_list = tag_list[:PARAMS_TAGS_PER_BATCH], tag_list[PARAMS_TAGS_PER_BATCH:]
            room = METRICS_PER_BATCH - len(p) - len(t)
            m, metric_list = metric_list[:room], metric_list[room:]
            self.client.log_batch(run_id, metrics=m, params=p, tags=t, synchronous=True)

def registry_name_problem(name: str) -> str | None:
    """Why the MLflow Model Registry would refuse `name`, by MLflow's own rule (not blank, no '/' or ':', a unique
    path; its file store also refuses '%'), or None."""
    from mlflow.utils.validation import _validate_model_name

    try:
        _validate_model_name(name)
    except MlflowException as exc:
        return exc.message.strip().splitlines()[0]
    return "Names cannot contain '%'." if "%" in name else None


def load_pyfunc(model_uri: str, tracking_uri: str):
    """The pyfunc model at `model_uri` (models:/<model id> or models:/<name>/<version>, else an artifact URI) of the
    store at `tracking_uri`, resolved through a client of that store (MLflow's process-wide tracking URI is left as
    it is) and loaded from a local copy (the Python API's ensemble loader)."""
    client = MlflowClient(tracking_uri=tracking_uri)
    uri = model_uri
    for _ in range(2):  # a registered version's source is a logged model's URI
        rest = uri.removeprefix("models:/")
        if rest == uri:
            break
        name, _, version = rest.partition("/")
        uri = client.get_model_version(name, version).source if version else \
            client.get_logged_model(name).artifact_location
    with tempfile.TemporaryDirectory(prefix="latentsweep-load-") as tmp:
        return mlflow.pyfunc.load_model(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=tmp))
