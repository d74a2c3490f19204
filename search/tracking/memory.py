"""An in-memory tracker with the same interface as the MLflow one, for unit tests and benchmarks."""
from __future__ import annotations

import tempfile
import uuid
from pathlib import Path
from typing import Any

from latentsweep.search.tracking.base import (
    PARAM_VALUE_MAX,
    PARENT_TAG,
    PLOTS_DIR,
    REAPED_TAG,
    ROLE_TAG,
    STATE_TAG,
    SUMMARY_STEP_KEY,
    STUDY_TAG,
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
from latentsweep.trainers.core.errors import LatentsweepError


class InMemoryTracker:
    """Tracker that records runs as dicts (name, params, tags, metrics {key: [(step, value)]}, artifacts, status)."""

    def __init__(self) -> None:
        self.runs: dict[str, dict[str, Any]] = {}
        self.study_name: str | None = None
        self.parent_run_id: str | None = None
        self.experiment_tags: dict[str, str] = {}
        self.experiment_id: str | None = None
        self.models: dict[str, dict[str, Any]] = {}  # model id -> name, source run, files, registered name

    def _new_run(self, name: str, tags: dict[str, str]) -> str:
        run_id = uuid.uuid4().hex
        self.runs[run_id] = {"name": name, "params": {}, "tags": dict(tags), "metrics": {}, "artifacts": [],
                             "inputs": [], "status": "RUNNING", "order": len(self.runs)}
        return run_id

    def _require_study(self) -> str:
        if self.parent_run_id is None:
            raise LatentsweepError("tracker has no study: call ensure_study or attach_study first")
        return self.parent_run_id

    def ensure_study(self, study_name: str, settings: dict[str, Any]) -> str:
        tags = parent_tags(study_name, settings)
        self.experiment_tags.update(experiment_tags(settings))
        parents = [rid for rid, run in self.runs.items() if run["tags"].get(ROLE_TAG) == "parent"
                   and run["tags"].get(STUDY_TAG) == study_name
                   and (UID_TAG not in tags or run["tags"].get(UID_TAG) == tags[UID_TAG])]
        parent = parents[0] if parents else self._new_run(f"study-{study_name}", tags)
        params, changed = split_settings(self.runs[parent]["params"], settings)
        self.runs[parent]["params"].update(params)
        self.runs[parent]["tags"].update(changed)
        self.runs[parent]["status"] = "RUNNING"
        self.study_name, self.parent_run_id = study_name, parent
        return parent

    def attach_study(self, study_name: str, parent_run_id: str, reopen: bool = True) -> None:
        run = self.runs.get(parent_run_id)
        if run is None or run["tags"].get(STUDY_TAG) != study_name:
            raise LatentsweepError(f"parent run {parent_run_id} of study '{study_name}' not found")
        if reopen:
            run["status"] = "RUNNING"
        self.study_name, self.parent_run_id = study_name, parent_run_id

    def start_trial(self, number: int, params: dict[str, Any], tags: dict[str, Any]) -> str:
        base, user = trial_tags(number, self.study_name, self._require_study(), tags)
        run_id = self._new_run(f"trial-{number}", {**base, **user})
        self.runs[run_id]["params"].update(clean_items(params, PARAM_VALUE_MAX))
        return run_id

    def log(self, run_id: str, *, metrics: dict[str, float] | None = None, step: int = 0,
            params: dict[str, Any] | None = None, tags: dict[str, Any] | None = None) -> None:
        run = self.runs[run_id]
        for key, value in clean_metrics(metrics or {}).items():
            run["metrics"].setdefault(key, []).append((int(step), value))
        run["params"].update(clean_items(params or {}, PARAM_VALUE_MAX))
        run["tags"].update(clean_items(tags or {}, TAG_VALUE_MAX))

    def log_dataset(self, run_id: str, dataset: DatasetRecord) -> None:
        self.runs[run_id]["inputs"].append(dataset)

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
        close_figure(figure)

    def end_trial(self, run_id: str, state: Any) -> None:
        name, status = status_of(state)
        self.runs[run_id]["tags"][STATE_TAG] = name
        self.runs[run_id]["status"] = status

    def end_study(self, summary: dict[str, Any], figures: dict[str, Any]) -> None:
        parent = self.runs[self._require_study()]
        metrics, tags = summary_entries(summary)
        step = int(summary.get(SUMMARY_STEP_KEY, 0))
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

    def close_stale_runs(self, alive_numbers: set[int]) -> list[str]:
        self._require_study()
        closed = []
        for rid in self.trial_runs():
            run = self.runs[rid]
            if run["status"] == "RUNNING" and int(run["tags"][TRIAL_TAG]) not in alive_numbers:
                run["status"] = "FAILED"
                run["tags"][REAPED_TAG] = "true"
                run["tags"][STATE_TAG] = "FAIL"
                closed.append(rid)
        return closed

    # ----- runs outside the trials (`latentsweep pick`) and models

    def open_experiment(self, study_name: str) -> str:
        self.study_name, self.experiment_id = study_name, study_name
        return study_name

    def has_run(self, run_id: str) -> bool:
        return run_id in self.runs and self.runs[run_id]["tags"].get(STUDY_TAG) == self.study_name

    def start_run(self, run_name: str, tags: dict[str, Any]) -> str:
        return self._new_run(run_name, clean_items(tags, TAG_VALUE_MAX))

    def end_run(self, run_id: str, status: str = "FINISHED") -> None:
        self.runs[run_id]["status"] = status

    def download_artifact(self, run_id: str, path: str, directory: Path) -> Path:
        raise LatentsweepError(f"run {run_id}: the in-memory tracker keeps artifact names, not files ({path})")

    def log_model(self, run_id: str, spec: ModelSpec, register: str | None = None) -> LoggedModel:
        """Stages the model's artifacts (so their code runs) and records their file names."""
        model_id = uuid.uuid4().hex
        with tempfile.TemporaryDirectory(prefix="latentsweep-model-") as tmp:
            artifacts = spec.stage(Path(tmp))
            files = sorted(f.relative_to(tmp).as_posix() for f in Path(tmp).rglob("*") if f.is_file())
        self.models[model_id] = {"name": spec.name, "run_id": run_id, "artifacts": sorted(artifacts), "files": files,
                                 "registered": register}
        return LoggedModel(model_id, f"models:/{model_id}", register, "1" if register else None)
