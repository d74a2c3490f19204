"""Launching studies on this machine: one process or K spawned workers, a study progress bar, the end-of-run refresh."""
from __future__ import annotations

import logging
import multiprocessing as mp
import threading
import warnings
from dataclasses import replace

import optuna
from tqdm.auto import tqdm

from search.objective import TrialRunner
from search.study import (
    RunSpec, best_summary, counted, cpu_threads, dispose_study, interrupt_as_keyboard, load_or_create, reap,
    study_dir, worker_loop,
)
from search.studyfile import load_study_file
from search.tracking import Tracker, make_tracker

log = logging.getLogger("latentsweep")
POLL_S = 2.0  # how often the main process refreshes the study bar from the storage when workers run elsewhere


def quiet_optuna() -> None:
    """Optuna's INFO lines duplicate our progress bar; heartbeats/stale-trial handling are 'experimental' in Optuna
    but relied on knowingly here (ask/tell with our own heartbeat thread)."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")


def run_worker(spec: RunSpec, create: bool = False, study: optuna.Study | None = None,
               tracker: Tracker | None = None) -> int:
    """One worker: load the study (created beforehand), reap dead trials, run trials until the budget is spent.

    `study`/`tracker` may be passed in by a caller that already opened them (saves MLflow's slow first connection).
    """
    import torch

    from trainers.data import load_train

    quiet_optuna()
    interrupt_as_keyboard()
    if spec.threads:
        torch.set_num_threads(spec.threads)
    sf = load_study_file(spec.study_file)
    data = load_train(spec.data_path)
    owned = study is None
    tracker = tracker or make_tracker(spec.tracking_uri, spec.artifact_root)
    study = study or load_or_create(sf, spec, tracker, create=create)
    bar = _StudyBar(spec, study) if spec.progress else None
    try:
        reap(study, tracker)
        runner = TrialRunner(sf, spec, data, tracker, study_dir(spec.state_dir, spec.name))
        return worker_loop(sf, spec, study, runner, on_trial=bar.update_from if bar else None)
    finally:
        if bar:
            bar.close()
        if owned:
            dispose_study(study)


def _worker_entry(spec: RunSpec) -> None:
    try:
        run_worker(spec)
    except KeyboardInterrupt:
        pass


class _StudyBar:
    """Trials done / budget and the best value so far."""

    def __init__(self, spec: RunSpec, study: optuna.Study):
        self.study, self.spec = study, spec
        self.bar = tqdm(total=spec.n_trials, initial=min(counted(study), spec.n_trials), desc=spec.name,
                        unit="trial", dynamic_ncols=True)
        self._best()

    def _best(self) -> None:
        try:
            self.bar.set_postfix({"best": f"{self.study.best_value:.4f}"})
        except ValueError:  # no complete trial yet
            pass

    def refresh(self) -> None:
        self.bar.n = min(counted(self.study), self.spec.n_trials)
        self._best()
        self.bar.refresh()

    def update_from(self, frozen) -> None:
        self.refresh()

    def close(self) -> None:
        self.bar.close()


def run_study(spec: RunSpec, workers: int = 1) -> dict:
    """Create/load the study, run it here with `workers` processes, refresh the parent run; returns the summary."""
    quiet_optuna()
    sf = load_study_file(spec.study_file)
    tracker = make_tracker(spec.tracking_uri, spec.artifact_root)
    study = load_or_create(sf, spec, tracker, create=True)
    interrupted = False
    try:
        if workers <= 1:
            run_worker(spec, study=study, tracker=tracker)
        else:
            _run_spawned(spec, study, workers)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        summary = finish(study, tracker)
        dispose_study(study)
    if interrupted:
        raise KeyboardInterrupt
    return summary


def _run_spawned(spec: RunSpec, study: optuna.Study, workers: int) -> None:
    ctx = mp.get_context("spawn")  # fork after torch/SQLAlchemy initialisation is unsafe
    child = replace(spec, threads=cpu_threads(workers), progress=False)
    procs = [ctx.Process(target=_worker_entry, args=(child,), name=f"worker-{i}") for i in range(workers)]
    for p in procs:
        p.start()
    bar = _StudyBar(spec, study) if spec.progress else None
    stop = threading.Event()
    try:
        while any(p.is_alive() for p in procs):
            if bar:
                bar.refresh()
            stop.wait(POLL_S)
    except KeyboardInterrupt:
        for p in procs:  # the children got SIGINT too; give them time to close their trials
            p.join(timeout=60)
        raise
    finally:
        for p in procs:
            p.join()
        if bar:
            bar.refresh()
            bar.close()


def finish(study: optuna.Study, tracker: Tracker) -> dict:
    """Refresh the parent run (summary + Optuna plots) and return the summary."""
    from search.plots import study_figures

    summary = best_summary(study)
    try:
        tracker.end_study(summary, study_figures(study))
    except Exception as exc:  # noqa: BLE001 - the study's results are in Optuna either way
        log.warning("could not refresh the study's MLflow parent run: %s", exc)
    return summary
