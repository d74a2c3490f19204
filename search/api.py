"""The Python API for notebooks: run a study, its trials as a DataFrame, pick, load the ensemble and predict.

Each call is the function the CLI command calls (`study run`, `study status`, `pick`), with keyword arguments for the
CLI's options and the same state directory (./mlruns, or `state_dir=`); progress bars are tqdm.auto's, so they
render as widgets in Jupyter and as text in logs. User errors raise LatentsweepError with the CLI's one-line message.
"""
from __future__ import annotations

import time as _time
from dataclasses import fields
from pathlib import Path

import numpy as np
import pandas as pd

from latentsweep.search.checks import check_count, check_outputs, check_registry_name, check_seconds, check_type
from latentsweep.search.pick.candidates import test_path_for
from latentsweep.search.pick.onebudget import OneBudgetResult, check_pick_inputs, parse_duration, run_one_budget
from latentsweep.search.pick.options import PickOptions, parse_budget
from latentsweep.search.pick.outputs import PickResult
from latentsweep.search.progress import honours_progress
from latentsweep.search.pick.picker import run_pick
from latentsweep.search.stores import default_protected, resolve_stores, state_dir as resolve_state_dir
from latentsweep.search.study.preflight import no_new_empty_state_dir, preflight
from latentsweep.search.study.devices import check_population, check_workers
from latentsweep.search.study.presets import presets as _presets
from latentsweep.search.study.report import load_existing_study, study_table
from latentsweep.search.study.runner import run_study as _run_study
from latentsweep.search.study.spec import build_spec
from latentsweep.search.study.studyfile import load_study_file
from latentsweep.search.study.worker import dispose_study
from latentsweep.trainers.data.sets import load_test, load_test_shared
from latentsweep.trainers.data.demo import default_test_path
from latentsweep.trainers.core.errors import LatentsweepError
from latentsweep.trainers.eval.submission import write_submission

__all__ = ["pick_ensemble", "load_ensemble", "predict", "presets", "run", "run_study", "trials", "write_submission"]


def presets() -> pd.DataFrame:
    """The bundled study files (runnable by name): name and description."""
    return pd.DataFrame(_presets(), columns=["name", "description"])


@honours_progress
def run_study(study: str | Path, *, data: str | None = None, n_trials: int | None = None,
              timeout: float | None = None, workers: int = 1, name: str | None = None, state_dir: str | None = None,
              storage: str | None = None, tracking_uri: str | None = None, artifact_root: str | None = None,
              progress: bool = True, warm_start: bool | None = None, warm_from: tuple[str, ...] = (),
              population: int | str = 1) -> dict:
    """Create or resume a study (a study file's path or a preset's name) and run its trials here, as `latentsweep
    study run`; returns the summary (trials by state, best value and trial). A new study first tries earlier
    studies' best configurations on the same data (`warm_start`, `warm_from`: docs/warm-start.md). `population`:
    trials trained side by side per worker, a number or "auto" (default 1: docs/gpu.md)."""
    check_population("population", population)
    _check_common(study, workers, progress, data=data, name=name, state_dir=state_dir, storage=storage,
                  tracking_uri=tracking_uri, artifact_root=artifact_root)
    if n_trials is not None:
        check_count("n_trials", n_trials)
    if timeout is not None:
        check_seconds("timeout", timeout)
    study_file = load_study_file(study)
    with no_new_empty_state_dir(state_dir):
        spec = build_spec(study_file, data=data, n_trials=n_trials, timeout=timeout, name=name, state=state_dir,
                          storage=storage, tracking_uri=tracking_uri, artifact_root=artifact_root,
                          progress=progress, warm_start=warm_start, warm_from=warm_from,
                          population=population)
        preflight(spec)
    return {"study": spec.name, **_run_study(spec, workers=workers)}


@honours_progress
def run(study: str | Path, time: str | float, *, data: str | None = None, test: str | None = None,
        register: str | None = None, workers: int = 1, state_dir: str | None = None, progress: bool = True,
        warm_start: bool | None = None, warm_from: tuple[str, ...] = (), population: int | str = 1
        ) -> OneBudgetResult:
    """Search and pick within one wall-clock budget, as `latentsweep run STUDY --time T` (T: seconds or "30m");
    returns the job's result (.summary of the study, .pick: the pick's result or None, .answer: the submission in
    place); the ensemble is registered under `register` (default: the study's name); `population` as in
    run_study."""
    started = _time.monotonic()  # the deadline's clock (latentsweep.trainers.core.deadline)
    check_population("population", population)
    _check_common(study, workers, progress, data=data, test=test, state_dir=state_dir)
    check_type("time", time, str, int, float)
    total = parse_duration(str(time))  # bounded: finite, at most a week
    if register is not None:
        check_registry_name("register", register)
    study_file = load_study_file(study)
    with no_new_empty_state_dir(state_dir):
        spec = build_spec(study_file, data=data, n_trials=None, timeout=None, name=None, state=state_dir,
                          storage=None, tracking_uri=None, artifact_root=None, progress=progress,
                          warm_start=warm_start, warm_from=warm_from, population=population)
        load_test_shared(test_path_for(Path(spec.data_path), test))  # a bad test file is said before a store is opened
        preflight(spec)
        pick = check_pick_inputs(PickOptions(  # every pick input before the search, as the CLI
            study=spec.name, state_dir=spec.state_dir, storage=spec.storage.url, tracking_uri=spec.tracking_uri,
            data=spec.data_path, test=test, register=register or spec.name, progress=progress), spec.data_path)
    return run_one_budget(spec, total, pick, workers, started)


def trials(study: str, *, state_dir: str | None = None, storage: str | None = None) -> pd.DataFrame:
    """The study's trials best first, as `latentsweep study status --csv`: number, state, value, duration and the
    knobs that vary."""
    check_type("study", study, str)
    _check_paths(state_dir=state_dir, storage=storage)
    url = resolve_stores(resolve_state_dir(state_dir, create=False), storage, read_only=True).storage
    loaded = load_existing_study(study, url)
    try:
        return study_table(loaded)
    finally:
        dispose_study(loaded)


@honours_progress
def pick_ensemble(study: str, *, state_dir: str | None = None, progress: bool = True, **options) -> PickResult:
    """Ensemble the study's best trials into a submission and an MLflow model, as `latentsweep pick`; `options` are
    pick's (top, folds, seeds, budget: seconds, "auto" or "none", selection, method, refit, data, test, out, ...)."""
    known = {f.name for f in fields(PickOptions)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise LatentsweepError(f"pick: unknown option(s) {', '.join(unknown)}; valid: {', '.join(sorted(known))}")
    if isinstance(options.get("budget"), str):  # "auto", "none" or seconds, as on the command line
        options["budget"] = parse_budget(options["budget"])
    return run_pick(PickOptions(study=study, state_dir=state_dir, progress=progress, **options))  # checks them all


def _check_common(study, workers, progress, **paths) -> None:
    """The arguments every study call takes: a study file's path or a preset's name, a worker count, paths."""
    check_type("study", study, str, Path)
    check_workers("workers", workers, auto=False)
    check_type("progress", progress, bool)
    _check_paths(**paths)


def _check_paths(**paths) -> None:
    for name, value in paths.items():
        check_type(name, value, str, Path, none=True)


def load_ensemble(picked: PickResult | str, tracking_uri: str | None = None, state_dir: str | None = None):
    """The picked ensemble as its MLflow pyfunc model (`.predict(caption_embeddings)` -> image-space [N, Di]):
    from a pick's result, or a model URI (models:/…) in the state directory's store or `tracking_uri`."""
    from latentsweep.search.tracking.mlflow import load_pyfunc  # imports MLflow: only when an ensemble is loaded

    if isinstance(picked, PickResult):
        if picked.model_uri is None:
            raise LatentsweepError(f"the pick of {picked.submission} logged no MLflow model (its run could not be "
                                   "written, or the budget left no time to export it): run `latentsweep pick` again")
        return load_pyfunc(picked.model_uri, picked.tracking_uri)
    uri = tracking_uri or resolve_stores(resolve_state_dir(state_dir, create=False)).tracking_uri
    return load_pyfunc(str(picked), uri)


def predict(model, test: str | Path | None = None, out: str | Path | None = None) -> pd.DataFrame:
    """Predict a test file's captions (default: the demo test) with a loaded ensemble: a DataFrame of caption id and
    embedding; with `out`, also written as a challenge submission CSV."""
    if out is not None:  # before any work: never over the test file, a store or a checkpoint
        check_outputs("out", [out], {"test": test or default_test_path()}, default_protected())
    test_set = load_test(test or default_test_path())
    embeddings = np.asarray(model.predict(test_set.embeddings), np.float32)
    if out is not None:
        write_submission(out, test_set.ids, embeddings)
    return pd.DataFrame({"id": test_set.ids, "embedding": list(embeddings)})
