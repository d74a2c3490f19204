"""Launching studies on this machine: one process or K spawned workers, a study progress bar, the end-of-run refresh."""
from __future__ import annotations

import multiprocessing as mp
import signal
import sys
import threading
from dataclasses import replace

import optuna
import torch
from tqdm.auto import tqdm

from latentsweep.search.failures import best_effort, release_interrupted
from latentsweep.search.process import (
    configure_process, interrupt_on, raise_if_interrupted, signals_blocked, spawned_child,
)
from latentsweep.search.progress import report_error

from latentsweep.search.study.budget import workers_stop
from latentsweep.search.study.contract import StudyRecord
from latentsweep.search.study.devices import assign_slots, pin_process
from latentsweep.search.study.objective import TrialRunner
from latentsweep.search.study.population import population_loop, population_size
from latentsweep.search.study.progress import trial_line
from latentsweep.search.study.report import load_existing_study, study_summary
from latentsweep.search.study.worker import (
    LiveTrialNumbers, RunSpec, check_halted, counted, cpu_threads, dispose_study, load_or_create, reap,
    open_tracker, reap_owner, study_dir, worker_id, worker_loop,
)
from latentsweep.search.tracking import make_tracker
from latentsweep.search.tracking.base import Tracker
from latentsweep.search.tracking.plots import study_figures
from latentsweep.trainers.data.sets import load_train_shared
from latentsweep.trainers.core.errors import LatentsweepError
from latentsweep.trainers.core.progress import say

# A worker sent SIGTERM closes its trial's run and fails it for retry: store calls of about a second on 2 cores.
STOP_GRACE_S = 10.0
POLL_S = 2.0  # how often the main process refreshes the study bar from the storage when workers run elsewhere


def run_worker(spec: RunSpec, create: bool = False, study: optuna.Study | None = None,
               tracker: Tracker | None = None) -> int:
    """One worker: load the study (created beforehand), reap dead trials, run trials until the budget is spent.

    `study`/`tracker` may be passed in by a caller that already opened them (saves MLflow's slow first connection).
    SIGTERM (docker stop, a scheduler) behaves like Ctrl-C meanwhile: the running trial is closed and retried.
    """
    with interrupt_on(signal.SIGINT, signal.SIGTERM):
        return _run_worker(spec, create, study, tracker)


def _run_worker(spec: RunSpec, create: bool, study: optuna.Study | None, tracker: Tracker | None) -> int:
    study_file = spec.parsed_study()
    data = load_train_shared(spec.data_path)  # the pre-flight check read it already
    owned = study is None
    tracker = tracker or open_tracker(spec)
    study = study or load_or_create(study_file, spec, tracker, create=create)
    bar = _StudyBar(spec, study) if spec.progress else None
    interrupted = False

    def on_trial(frozen) -> None:
        say(trial_line(study, frozen))  # one plain line per trial, with or without a bar (--quiet included)
        if bar:
            bar.update_from(frozen)

    try:
        reap(study, tracker)
        runner = TrialRunner(study_file, spec, data, tracker, study_dir(spec.state_dir, spec.name))
        size = population_size(spec.population, study_file, spec, data)
        if size > 1:  # K trials side by side, each its own trial and run (latentsweep.search.study.population)
            return population_loop(study_file, spec, study, runner, size, on_trial=on_trial)
        return worker_loop(study_file, spec, study, runner, on_trial=on_trial)
    except KeyboardInterrupt as exc:  # between trials (the halted check, the search-end estimate): no trial failed it
        interrupted = True
        release_interrupted(exc)  # it may have landed inside a store call: closing the parent run writes next
        with best_effort("fail the trials this worker had claimed"):  # a store down: the heartbeat reaps them later
            reap_owner(study, tracker, worker_id())  # one the signal caught between its claim and its start
        raise
    finally:
        if bar:
            bar.close()
        if owned:  # no figures after an interrupt: one may have cut matplotlib's import short (a re-import fails)
            close_parent_if_idle(study, tracker, figures=not interrupted)
            dispose_study(study)


def close_parent_if_idle(study: optuna.Study, tracker: Tracker, figures: bool = True) -> None:
    """A worker that joined on its own (`latentsweep worker`) ends the parent run when no trial runs any more, so
    the last worker out leaves nothing RUNNING in MLflow (a later worker or `study run` reopens it)."""
    with best_effort("close the study's MLflow parent run"):  # a store down or a full disk
        if not study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
            finish(study, tracker, figures)


def worker_main(spec: RunSpec) -> None:
    """The entry of a spawned worker process: its process-wide settings, then run_worker; a user error is the CLI's
    one line on stderr and its exit code (no traceback)."""
    configure_process()
    if spec.threads:  # the share of this machine's cores of one of several local workers
        torch.set_num_threads(spec.threads)
    try:
        pin_process(spec.cuda_visible)  # its GPU slot, before anything asks CUDA (the driver reads it once)
        run_worker(spec)
    except KeyboardInterrupt:
        pass
    except Exception as exc:  # the CLI's one error line (search/progress.py report_error); a bug keeps its traceback
        code = report_error(exc)
        if code is None:
            raise
        sys.exit(code)


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


def run_study(spec: RunSpec, workers: int = 1, figures: bool = True) -> dict:
    """Create/load the study, run it here with `workers` processes, refresh the parent run (with the Optuna figures
    unless `figures` is False: a one-budget run draws them after its submission); returns the summary."""
    study_file = spec.parsed_study()
    tracker = open_tracker(spec)
    study = load_or_create(study_file, spec, tracker, create=True)
    interrupted = False
    try:
        if workers <= 1 and not spec.gpus:  # a worker on a GPU of --gpus is spawned: pinned before CUDA starts
            run_worker(spec, study=study, tracker=tracker)
        else:
            _run_spawned(spec, study, workers, tracker)
            check_halted(study)  # a worker stopped on a bug: so does `study run`, after closing what is open
    except KeyboardInterrupt as exc:
        interrupted = True
        release_interrupted(exc)  # it may have landed inside a store call: finish() writes next
    finally:
        if interrupted:
            close_orphan_runs(study, tracker)
        summary = finish(study, tracker, figures and not interrupted)  # the next run draws them (see _run_worker)
        dispose_study(study)
    if interrupted:
        raise KeyboardInterrupt
    return summary


def close_orphan_runs(study: optuna.Study, tracker: Tracker) -> None:
    """After an interrupt, close every trial run still RUNNING whose trial is not: the signal can land inside the
    tracker's run creation, after the store wrote the run and before its id reached the trial (nothing then knows
    the run to close it). A trial's run is opened after the trial is claimed and closed before it is told, so such a
    run is an orphan."""
    with best_effort("close the interrupted trial's MLflow run"):  # a store down: `study reap` closes it later
        tracker.close_stale_runs(LiveTrialNumbers(study.get_trials(deepcopy=False)))


def _run_spawned(spec: RunSpec, study: optuna.Study, workers: int, tracker: Tracker) -> None:
    """`workers` spawned worker processes until they end, the watchdog stops them, or this process is interrupted
    (Ctrl-C, SIGTERM, SIGHUP): then each is sent SIGTERM (it closes its trial, which is retried) and killed after
    STOP_GRACE_S, and the trials of any that died are failed for retry at once. No worker outlives this call."""
    ctx = mp.get_context("spawn")  # fork after torch/SQLAlchemy initialisation is unsafe
    child = replace(spec, threads=cpu_threads(workers), progress=False)
    slots = assign_slots(spec.gpus, spec.per_gpu, workers)  # each worker's GPU; all None without --gpus
    procs = [ctx.Process(target=spawned_child, args=(worker_main, replace(child, cuda_visible=slots[i])),
                         name=f"worker-{i}") for i in range(workers)]
    bar = None
    stop, watchdog = threading.Event(), workers_stop(spec.budget, spec.timeout)
    reaped: set[int] = set()
    try:
        for p in procs:
            with signals_blocked():  # the child starts with them held; spawned_child decides what they mean
                p.start()
        bar = _StudyBar(spec, study) if spec.progress else None
        while any(p.is_alive() for p in procs):
            raise_if_interrupted()  # a first KeyboardInterrupt a finalizer swallowed
            _reap_dead_children(study, tracker, procs, reaped)
            if bar:
                bar.refresh()
            if watchdog.passed():
                _stop_children(procs)
                break
            stop.wait(POLL_S)
    except KeyboardInterrupt:
        # Children in start-up ignore the terminal's SIGINT: they get SIGTERM; 60 s for closing their trials on a
        # loaded machine (the parent's wait before this change).
        _stop_children(procs, quiet=True, grace=60.0)
        raise
    finally:
        try:
            for p in procs:
                if p.pid is not None:
                    p.join()
        finally:
            for p in procs:  # a forced stop (a third signal) still leaves no worker behind
                if p.is_alive():
                    p.kill()
                    p.join()
            _reap_dead_children(study, tracker, procs, reaped)
            if bar:
                bar.refresh()
                bar.close()


def _stop_children(procs, quiet: bool = False, grace: float = STOP_GRACE_S) -> None:
    """Workers still running get SIGTERM (each closes its trial, which is retried, as on Ctrl-C), then SIGKILL after
    `grace` seconds (a dead worker's trial is reaped by the caller). The watchdog's stop at the search's end is said in
    a line; a stop on an interrupt (`quiet`) is not (the command says it was interrupted)."""
    alive = [p for p in procs if p.is_alive()]
    if alive and not quiet:
        say(f"stopping {len(alive)} worker(s) still running at the search's end")
    for p in alive:
        p.terminate()
    for p in alive:
        p.join(timeout=grace)
        if p.is_alive():
            p.kill()


def _reap_dead_children(study: optuna.Study, tracker: Tracker, procs, reaped: set[int]) -> None:
    """A child that died (killed, crashed) cannot close its trial: fail and retry it now instead of after the
    heartbeat grace period, so the other workers pick the retry up at once."""
    for p in procs:
        if p.pid not in reaped and not p.is_alive():
            reaped.add(p.pid)
            closed = []
            with best_effort(f"reap the trials of dead worker {p.name}"):  # the heartbeat reaper does, after the grace
                closed = reap_owner(study, tracker, worker_id(p.pid))
            if closed:
                say(f"worker {p.name} died (exit code {p.exitcode}); its trial was failed and queued for retry")


def finish(study: optuna.Study, tracker: Tracker, figures: bool = True) -> dict:
    """Refresh the parent run (summary, and the Optuna plots when `figures`) and return the summary."""
    summary = study_summary(study)
    with best_effort("refresh the study's MLflow parent run"):  # a store down: the results are in Optuna anyway
        tracker.end_study(summary, study_figures(study, StudyRecord.of(study).objective) if figures else {})
    return summary


def reap_study(name: str, stores) -> list:
    """Fail the trials of dead workers of study `name` (they are retried) and close their MLflow runs, and the parent
    run when no trial runs any more; returns the trial runs closed. `stores`: a
    latentsweep.search.study.preflight.StoreSpec whose
    storage carries the heartbeat/grace rule."""
    study = load_existing_study(name, stores.storage.url, stores.storage.heartbeat_interval,
                                stores.storage.grace_period)
    try:
        parent = StudyRecord.of(study).parent_run_id
        if not parent:
            raise LatentsweepError(f"study '{name}' has no MLflow parent run recorded")
        tracker = make_tracker(stores.tracking_uri, stores.artifact_root)
        tracker.attach_study(name, parent, reopen=False)  # reaping never reopens a finished run
        closed = reap(study, tracker)
        close_parent_if_idle(study, tracker)  # a study that stopped on a full disk or a store outage left it open
        return closed
    finally:
        dispose_study(study)
