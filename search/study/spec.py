"""A study run's RunSpec from a study file and the stores' defaults: what `study run|create`, `worker` and the Python
API build before they launch anything."""
from __future__ import annotations

from pathlib import Path

from latentsweep.search.checks import check_seconds
from latentsweep.search.stores import resolve_stores, safe_name, state_dir
from latentsweep.search.study.devices import check_population
from latentsweep.search.study.preflight import check_liveness
from latentsweep.search.study.storage import StorageSettings
from latentsweep.search.study.studyfile import StudyFile, resolve_data_path
from latentsweep.search.study.worker import RunSpec
from latentsweep.trainers.core.errors import LatentsweepError

HEARTBEAT_S, GRACE_S = 60, 180  # a minute between heartbeats for minute-long trials; 3 missed beats = dead


def build_spec(study_file: StudyFile, *, data: str | None = None, n_trials: int | None = None,
               timeout: float | None = None, name: str | None = None, state: str | None = None,
               storage: str | None = None, tracking_uri: str | None = None, artifact_root: str | None = None,
               heartbeat: int = HEARTBEAT_S, grace: int = GRACE_S, progress: bool = True,
               verbose: bool = False, population: int | str = 1,
               warm_start: bool | None = None, warm_from: tuple[str, ...] = ()) -> RunSpec:
    """RunSpec from explicit values, the study file and the state-directory defaults (checked, one-line errors)."""
    check_liveness(heartbeat, grace)
    population = check_population("--population", population)
    if n_trials is not None and n_trials < 1:  # 0 must not fall back to the file's value
        raise LatentsweepError(f"--n-trials must be >= 1, got {n_trials}")
    if timeout is not None:
        check_seconds("--timeout", timeout)
    name = safe_name(name, "--name") if name is not None else None
    stores = resolve_stores(state_dir(state), storage, tracking_uri, artifact_root)
    train = resolve_data_path(data or study_file.base.data.path)
    return RunSpec(
        study_file=str(study_file.path), name=name or study_file.name,
        storage=StorageSettings(stores.storage, heartbeat, grace),
        tracking_uri=stores.tracking_uri, artifact_root=stores.artifact_root,
        state_dir=str(stores.root), data_path=str(train),
        n_trials=n_trials if n_trials is not None else study_file.n_trials,
        timeout=timeout if timeout is not None else study_file.timeout, progress=progress, verbose=verbose,
        population=population,
        warm_start=None if warm_start is None else bool(warm_start),
        warm_from=(str(warm_from),) if isinstance(warm_from, (str, Path)) else tuple(map(str, warm_from)),
        parsed=study_file,
    )
