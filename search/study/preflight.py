"""The pre-flight checks of `study run|create|worker|reap`: everything that can fail is said in one line before
anything is written to either store (no Optuna study without its MLflow parent run, no empty state directory left)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

from latentsweep.search.checks import check_outputs
from latentsweep.search.stores import check_artifact_root, local_artifact_path, sqlite_path, state_dir
from latentsweep.search.study.space import config_key
from latentsweep.search.study.storage import (
    StorageSettings, dispose, open_storage, redact_url, tracking_has_experiment,
)
from latentsweep.search.study.studyfile import StudyFile
from latentsweep.search.study.worker import RunSpec, check_existing
from latentsweep.search.tracking.base import DB_SCHEMES
from latentsweep.search.tracking.paths import default_artifact_root
from latentsweep.search.tracking.probe import probe_tracking_store
from latentsweep.trainers.config.tree import with_values
from latentsweep.trainers.data.sets import load_train_shared
from latentsweep.trainers.core.errors import LatentsweepError, closest
from latentsweep.trainers.core.devices import check_device, cuda_count
from latentsweep.trainers.train.tasks import TASKS, check_split
from latentsweep.trainers.config.validate import validate

@dataclass(frozen=True)
class StoreSpec:
    """The stores a command will write: Optuna storage, MLflow tracking URI and artifact root, and the study name
    (None when the command creates no experiment)."""
    storage: StorageSettings
    tracking_uri: str
    artifact_root: str | None
    name: str | None = None

    @classmethod
    def of(cls, spec: RunSpec) -> "StoreSpec":
        return cls(spec.storage, spec.tracking_uri, spec.artifact_root, spec.name)


def check_liveness(heartbeat: int, grace: int) -> None:
    if heartbeat < 1 or grace <= heartbeat:
        # a grace period within one beat would declare live trials dead (they would then run twice)
        raise LatentsweepError(f"--grace ({grace} s) must be longer than --heartbeat ({heartbeat} s), "
                               f"and --heartbeat at least 1 s")


def preflight(spec: RunSpec) -> None:
    """Fail before any trial, with everything that can be known then: the base config validates on this machine,
    the data loads and splits, the objective is a logged metric, both stores answer, and a stored study of that
    name agrees with the file (direction, distributions of its knobs)."""
    study_file = spec.parsed_study()
    check_store_paths(spec)
    validate(study_file.base)
    check_devices(study_file, spec)
    keys = TASKS.get(study_file.base.data.task).val_keys(study_file.base)
    if study_file.objective not in keys:
        raise LatentsweepError(f"{study_file.path}: study.objective '{study_file.objective}' is not a metric task "
                               f"'{study_file.base.data.task}' logs{closest(study_file.objective, keys)}; "
                               f"valid: {', '.join(keys)}")
    check_split(with_values(study_file.base, {"data.path": spec.data_path}), load_train_shared(spec.data_path))
    check_stores(StoreSpec.of(spec))
    check_existing(study_file, spec)


def check_store_paths(spec: RunSpec) -> None:
    """The stores a study writes (local SQLite files, a local artifact root) are none of its inputs."""
    inputs = {"STUDY": spec.study_file, "--data": spec.data_path}
    for option, url in (("--storage", spec.storage.url), ("--tracking-uri", spec.tracking_uri)):
        db = sqlite_path(url)
        if db is not None:
            check_outputs(option, [db], inputs)
    root = local_artifact_path(spec.artifact_root) if spec.artifact_root else None
    if root is not None:
        check_outputs("--artifact-root", [root], inputs)


def study_devices(study_file: StudyFile) -> list[tuple[str, str]]:
    """(where, name) of every train.device a trial of the study can get: [base], each [[side]] and [[enqueue]]
    entry, and each choice of a searched train.device."""
    found = [("base: train.device", study_file.base.train.device)]
    found += [(f"side[{i}]: train.device", v["train.device"]) for i, v in enumerate(study_file.side)
              if "train.device" in v]
    found += [(f"enqueue[{i}]: {name}", value) for i, v in enumerate(study_file.enqueue) for name, value in v.items()
              if config_key(name) == "train.device"]
    found += [(f"space: {p.name}", c) for p in study_file.space if p.key == "train.device" for c in p.choices or ()]
    return found


def check_devices(study_file: StudyFile, spec: RunSpec) -> None:
    """Every device the study's trials can ask for exists where they will run: on this machine, or with --gpus on
    the one GPU each worker sees (its cuda:0)."""
    count = 1 if spec.gpus else cuda_count()
    for where, name in study_devices(study_file):
        try:
            check_device(str(name), count)
        except LatentsweepError as exc:
            pinned = " (each worker is pinned to one GPU, which it sees as cuda:0)" if spec.gpus else ""
            raise LatentsweepError(f"{study_file.path}: {where}: {exc}{pinned}") from None


def check_stores(spec: StoreSpec) -> None:
    """One-line errors, before anything is written to either store (no study without its MLflow parent run).

    The tracking store is probed as the MLflow client would use it (latentsweep.search.tracking.probe), then the Optuna
    storage
    is opened once.
    """
    probe_tracking_store(spec.tracking_uri)  # first: it writes nothing, while opening SQLite creates the file
    if spec.artifact_root:
        check_artifact_root(spec.artifact_root)
    else:
        _check_artifact_root_needed(spec)
    dispose(open_storage(spec.storage))


def _check_artifact_root_needed(spec: StoreSpec) -> None:
    """A database tracking store needs an artifact root to create the study's experiment (else MLflow would use
    ./mlruns of whichever process creates it): said now, before the Optuna study is created, not after."""
    url = spec.tracking_uri
    if url.split(":", 1)[0].split("+")[0] not in DB_SCHEMES or default_artifact_root(url) is not None:
        return  # not a database, or SQLite: the tracker keeps artifacts beside its file
    if spec.name is not None and not tracking_has_experiment(url, spec.name):
        raise LatentsweepError(f"MLflow tracking URI {redact_url(url)} is a database and has no experiment "
                               f"'{spec.name}' yet: an artifact root is required (--artifact-root)")


@contextlib.contextmanager
def no_new_empty_state_dir(arg: str | Path | None):
    """A command rejected by its checks leaves no empty state directory behind (it was made only to be checked)."""
    path = state_dir(arg, create=False)
    existed = path.exists()
    try:
        yield
    except BaseException:
        if not existed:
            with contextlib.suppress(OSError):  # not empty: a store was opened, keep it
                (path / ".write-probe").unlink(missing_ok=True)
                path.rmdir()
        raise
