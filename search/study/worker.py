"""Running studies: create/load an Optuna study, claim trials within an exact budget, run them, track them in MLflow."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import optuna
from optuna.trial import TrialState

from latentsweep.search.failures import Kind, StudyHalted, classify, release_interrupted
from latentsweep.search.process import raise_if_interrupted, stops_deferred
from latentsweep.search.redact import redact_url
from latentsweep.search.study.budget import JobBudget
from latentsweep.search.study.contract import (ENQUEUED_ATTR, ERROR_ATTR, HALT_ATTR, OBJECTIVE_ATTR, OWNER_ATTR,
                                               PARENT_ATTR, PLUGINS_ATTR, TrialOutputs, WARM_ATTR, study_attrs)
from latentsweep.search.study.objective import TrialRunner
from latentsweep.search.study.owners import gone, worker_id
from latentsweep.search.study.samplers import DEFAULT, build_pruner, build_sampler
from latentsweep.search.study.side import enqueue_side
from latentsweep.search.study.storage import (
    RetryAndRecord, StorageSettings, budget_lock, dispose, open_storage, schema_lock, storage_of, trial_id,
)
from latentsweep.search.stores import safe_name
from latentsweep.search.study.studyfile import StudyFile, load_study_file
from latentsweep.search.study.warm import learn_from_earlier, queue_portfolio, warm_start
from latentsweep.search.tracking import make_tracker
from latentsweep.search.tracking.base import REAPED_TAG, SEARCHED_SETTING, VIEW_TAGS_SETTING, Tracker
from latentsweep.trainers.core.devices import usable_cores
from latentsweep.trainers.core.errors import LatentsweepError
from latentsweep.trainers.config.plugins import parse_ref
from latentsweep.trainers.core.progress import say


# The budget counts finished trials: complete, pruned, and failed for good (ERROR_ATTR: a config that cannot train or
# does not fit in memory, or a bug). Trials failed by the machine, a store, an interrupt or a dead worker are retried,
# so they do not count (latentsweep.search.failures says which is which).
COUNTED = (TrialState.COMPLETE, TrialState.PRUNED)
# A worker with nothing to claim while others' trials still run re-checks this often (capped by the heartbeat
# interval): one of those trials may die and need its retry run. A few cheap queries; 5 s keeps the idle tail short.
WAIT_POLL_S = 5.0
# MLflow's error codes for a run id it does not have (a damaged or hand-edited study's mlflow_run_id).
UNKNOWN_RUN = ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE")


@dataclass(frozen=True)
class RunSpec:
    """Everything a worker process needs (picklable: workers are spawned)."""
    study_file: str
    name: str
    storage: StorageSettings
    tracking_uri: str
    artifact_root: str | None
    state_dir: str
    data_path: str
    n_trials: int
    timeout: float | None
    threads: int = 0
    progress: bool = True  # tqdm bars (a terminal and no --quiet); the per-trial lines are printed regardless
    verbose: bool = False  # one line per epoch when there are no bars
    budget: JobBudget | None = None  # a one-budget run's clock: trials stop where the pick's reserve begins
    gpus: tuple[str, ...] = ()  # the GPUs local workers share (CUDA_VISIBLE_DEVICES entries; search/study/devices.py)
    per_gpu: int = 1  # local workers per GPU
    cuda_visible: str | None = None  # the GPU this spawned worker sees (set before its first CUDA call); None: as is
    # trials each worker trains side by side: a number, or "auto" (population.py's population_size: sized on the
    # worker's GPU, 1 on a CPU); 1, the default (devices.machine_defaults), is the one-trial worker_loop
    population: int | str = 1
    # at creation, queue earlier studies' best configs on the same data; None: as $LATENTSWEEP_WARM_START says
    warm_start: bool | None = None
    warm_from: tuple[str, ...] = ()  # more places to look for them: state directories or Optuna storage URLs
    # `study_file` parsed (latentsweep.search.study.spec.build_spec sets it): read through parsed_study(), never pickled
    parsed: StudyFile | None = field(default=None, repr=False, compare=False)

    def parsed_study(self) -> StudyFile:
        """The study file, parsed once per process: the one build_spec parsed, else (a spawned worker) parsed here
        once, which also loads its plugin files into this process."""
        if self.parsed is None:
            object.__setattr__(self, "parsed", load_study_file(self.study_file))  # a cache of a frozen value
        return self.parsed

    def __getstate__(self) -> dict:
        # a spawned worker parses its own copy: the parse is what loads the plugin files into its process
        return {**self.__dict__, "parsed": None}


def check_plugins(study, study_file: StudyFile, write: bool) -> None:
    """Every worker of a study loads the same plugin files (by sha256, from its own copy of the study file): the
    first records them on the study, a worker whose files differ stops before its first trial."""
    mine = {Path(path).name: sha for path, sha in map(parse_ref, study_file.plugins)}
    recorded = study_attrs(study).get(PLUGINS_ATTR)
    if recorded is None:
        if write:
            study.set_user_attr(PLUGINS_ATTR, mine)
    elif recorded != mine:
        differ = sorted(n for n in set(recorded) | set(mine) if recorded.get(n) != mine.get(n))
        raise LatentsweepError(f"study '{study.study_name}': plugin file(s) {', '.join(differ)} differ from the "
                               f"ones the study was created with (sha256 {recorded}); every worker needs the same "
                               f"files")


def load_or_create(study_file: StudyFile, spec: RunSpec, tracker: Tracker, create: bool = True,
                   reopen: bool = True) -> optuna.Study:
    """The study named spec.name (created with the file's sampler/pruner if absent), its parent run and recipes."""
    storage = open_storage(spec.storage)
    sampler, pruner = build_sampler(study_file.sampler, per_worker=not create), build_pruner(study_file.pruner)
    if create:
        study = optuna.create_study(study_name=spec.name, storage=storage, sampler=sampler, pruner=pruner,
                                    direction=study_file.direction, load_if_exists=True)
    else:
        try:
            study = optuna.load_study(study_name=spec.name, storage=storage, sampler=sampler, pruner=pruner)
        except KeyError:
            raise LatentsweepError(f"study '{spec.name}' does not exist in {redact_url(spec.storage.url)}: "
                                   f"create it with `latentsweep study create`") from None
    existing = len(study.get_trials(deepcopy=False))
    if existing:  # resumed: a sampler seeded as at the start would propose trial 0's values again
        study.sampler = build_sampler(study_file.sampler, per_worker=not create, history=existing)
    attrs = study_attrs(study)
    check_plugins(study, study_file, write=reopen)
    if create and attrs.get(HALT_ATTR):  # `study run`/`study create` again: the user has dealt with the bug
        say(f"study '{spec.name}' was halted ({attrs[HALT_ATTR]}); resuming it")
        study.set_user_attr(HALT_ATTR, "")
    if not reopen:  # read-only use (study reap): bind to the parent run as it is, write nothing to the study
        if PARENT_ATTR in attrs:
            tracker.attach_study(spec.name, attrs[PARENT_ATTR], reopen=False)
        return study
    if PARENT_ATTR in attrs:
        tracker.attach_study(spec.name, attrs[PARENT_ATTR])
    else:
        settings = {"study_file": str(study_file.path), "objective": study_file.objective,
                    "direction": study_file.direction,
                    "sampler": study_file.sampler.get("name", DEFAULT["sampler"]),
                    "pruner": study_file.pruner.get("name", DEFAULT["pruner"]),
                    "n_trials": str(spec.n_trials), "data": spec.data_path, "description": study_file.description,
                    SEARCHED_SETTING: ",".join(p.key for p in study_file.space), VIEW_TAGS_SETTING: (WARM_ATTR,)}
        study.set_user_attr(PARENT_ATTR, tracker.ensure_study(spec.name, settings))
    if not attrs.get(ENQUEUED_ATTR):
        # side trials (cheap) before earlier studies' best: the other way, loaded 60-s runs kept the floor (results.md)
        enqueue_side(study, study_file.side)
        portfolio_due = warm_start(study, study_file, spec.data_path, spec.warm_start, spec.warm_from)
        for values in study_file.enqueue:
            study.enqueue_trial(values, user_attrs={ENQUEUED_ATTR: True}, skip_if_exists=True)
        if portfolio_due:  # nothing earlier on this data (latentsweep.search.study.warm)
            queue_portfolio(study, study_file)
        study.set_user_attr(ENQUEUED_ATTR, True)
    else:  # resumed or joined: nothing queued, but the sampler learns from the earlier studies as at creation
        learn_from_earlier(study, study_file, spec.data_path, spec.warm_start, spec.warm_from, quiet=not create)
    study.set_user_attr(OBJECTIVE_ATTR, study_file.objective)
    if study.metric_names != [study_file.objective]:
        study.set_metric_names([study_file.objective])  # optuna-dashboard labels the value with it, not "Objective 0"
    return study


def open_tracker(spec: RunSpec) -> Tracker:
    """The tracker of spec; a first-time SQLite tracking store is created under a lock (MLflow migrates its schema
    on first use, and two first runs racing on it would kill one)."""
    with schema_lock(spec.tracking_uri):
        return make_tracker(spec.tracking_uri, spec.artifact_root)


def check_existing(study_file: StudyFile, spec: RunSpec) -> None:
    """A stored study of this name must agree with the file before anything runs: the same direction, and every
    searched knob with a distribution of the kind its trials stored (Optuna refuses the first suggest otherwise,
    which would fail each trial in turn). Reads only; a study not stored yet passes."""
    storage = open_storage(spec.storage)
    try:
        try:
            study_id = storage.get_study_id_from_name(spec.name)
        except KeyError:
            return
        stored = storage.get_study_directions(study_id)[0].name.lower()
        if stored != study_file.direction:
            raise LatentsweepError(f"study '{spec.name}' is stored with direction {stored} but {study_file.path} says "
                                   f"{study_file.direction}: fix the file or use another --name")
        wanted = {p.key: p.distribution() for p in study_file.space}
        seen: set[str] = set()
        for trial in reversed(storage.get_all_trials(study_id, deepcopy=False)):
            for key, dist in trial.distributions.items():
                if key in wanted and key not in seen:
                    seen.add(key)
                    try:
                        optuna.distributions.check_distribution_compatibility(dist, wanted[key])
                    except ValueError as exc:
                        raise LatentsweepError(
                            f"study '{spec.name}' stores {key} as {dist} but {study_file.path} searches {wanted[key]} "
                            f"({str(exc).rstrip('.')}): use another --name") from None
    finally:
        dispose(storage)


def counted(study: optuna.Study, extra: tuple[TrialState, ...] = ()) -> int:
    trials = study.get_trials(deepcopy=False)
    return sum(t.state in COUNTED + extra or (t.state == TrialState.FAIL and ERROR_ATTR in t.user_attrs)
               for t in trials)


def claim_trial(study: optuna.Study, n_trials: int) -> optuna.Trial | None:
    """Under the budget lock: fail dead workers' trials (they get retried), then ask for a trial if budget remains.
    The new trial's first heartbeat is recorded before the lock is released: Optuna never counts a RUNNING trial
    without any heartbeat as stale, so a worker killed before its heartbeat thread started would block the budget."""
    with budget_lock(storage_of(study), study.study_name):
        optuna.storages.fail_stale_trials(study)
        fail_dead_local(study)
        if counted(study, (TrialState.RUNNING,)) >= n_trials:
            return None
        trial = None
        try:
            with stops_deferred():  # a stop inside ask() would leave its new trial RUNNING, unowned, for good
                trial = study.ask()
            storage_of(study).record_heartbeat(trial_id(trial))
            trial.set_user_attr(OWNER_ATTR, worker_id())
        except BaseException:
            if trial is not None:  # told FAIL: without a heartbeat it would never go stale
                study.tell(trial, state=TrialState.FAIL)
            raise
        return trial


def _fail_running(study: optuna.Study, dead: Callable[[optuna.trial.FrozenTrial], bool]) -> None:
    """Fail the RUNNING trials `dead` picks and queue their retries (the storage's stale-trial callback, which also
    records them for close_dead_runs). Called under the budget lock."""
    storage = storage_of(study)
    callback = storage.get_heartbeat_stale_trial_callback()
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if dead(trial) and storage.set_trial_state_values(trial_id(trial), state=TrialState.FAIL) \
                and callback is not None:
            callback(study, storage.get_trial(trial_id(trial)))


def fail_dead_local(study: optuna.Study) -> None:
    """A RUNNING trial whose worker ran on this machine and is gone (killed, crashed) is failed and retried now, not
    after the heartbeat's grace (minutes: a resumed job would otherwise end with it RUNNING)."""
    _fail_running(study, gone)


def reap_owner(study: optuna.Study, tracker: Tracker, owner: str) -> list[str]:
    """Fail (and queue the retry of) the RUNNING trials of a worker known to be dead, then close their runs."""
    with budget_lock(storage_of(study), study.study_name):
        _fail_running(study, lambda trial: trial.user_attrs.get(OWNER_ATTR) == owner)
    return close_dead_runs(study, tracker)


class LiveTrialNumbers(frozenset):
    """Trial numbers whose MLflow run may be RUNNING: running or waiting at the snapshot, or created after it (the
    MLflow search comes after the snapshot, so it can see the fresh run of a trial another worker just claimed)."""

    def __new__(cls, trials: list[optuna.trial.FrozenTrial]):
        alive = super().__new__(cls, (t.number for t in trials
                                      if t.state in (TrialState.RUNNING, TrialState.WAITING)))
        alive.first_new = len(trials)  # trial numbers are dense per study: later trials get numbers >= this
        return alive

    def __contains__(self, number) -> bool:
        return number >= self.first_new or super().__contains__(number)


def close_dead_runs(study: optuna.Study, tracker: Tracker) -> list[str]:
    """Close as FAILED the runs of the trials this process just found dead (see RetryAndRecord), then every other
    run still RUNNING whose trial is finished or failed (e.g. failed by a process that died before closing it)."""
    callback = storage_of(study).get_heartbeat_stale_trial_callback()
    closed = []
    for trial in callback.drain() if isinstance(callback, RetryAndRecord) else []:
        # absent when the worker died before opening the run
        run_id = TrialOutputs.of(trial, study.study_name).mlflow_run_id
        if run_id:
            try:
                tracker.log(run_id, tags={REAPED_TAG: "true"})
                tracker.end_trial(run_id, TrialState.FAIL)
            except Exception as exc:  # a damaged study: its recorded run is not one the tracking store has
                if getattr(exc, "error_code", None) not in UNKNOWN_RUN:
                    raise
                say(f"trial {trial.number} was failed for retry; its recorded MLflow run {run_id!r} is not in the "
                    "tracking store (no run closed)")
                continue
            closed.append(run_id)
    return closed + tracker.close_stale_runs(LiveTrialNumbers(study.get_trials(deepcopy=False)))


def reap(study: optuna.Study, tracker: Tracker) -> list[str]:
    """Fail trials whose worker stopped beating or is gone from this machine (they get retried) and close their MLflow
    runs as FAILED.

    Failing happens under the budget lock, like in claim_trial, so concurrent reapers queue exactly one retry.
    """
    with budget_lock(storage_of(study), study.study_name):
        optuna.storages.fail_stale_trials(study)
        fail_dead_local(study)
    return close_dead_runs(study, tracker)


class Heartbeat:
    """Record a heartbeat for a running trial every interval from a daemon thread (ask/tell runs have none)."""

    def __init__(self, storage, trial_id: int):
        self.storage, self.trial_id = storage, trial_id
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._beat, daemon=True)

    def _beat(self) -> None:
        interval = self.storage.get_heartbeat_interval() or 60
        warned = False
        while not self.stop.is_set():
            try:
                self.storage.record_heartbeat(self.trial_id)
            except Exception as exc:  # noqa: BLE001 - a dead thread would get a live trial failed and run twice
                if not warned:  # a bug is logged with its traceback (a thread cannot stop the worker)
                    failure = classify(exc)
                    why = failure.detail if failure.kind is Kind.BUG else failure.reason
                    say(f"heartbeat of trial id {self.trial_id} failed ({why}); retrying every {interval:.0f} s")
                    warned = True
            self.stop.wait(interval)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


def worker_loop(study_file: StudyFile, spec: RunSpec, study: optuna.Study, runner: TrialRunner,
                on_trial: Callable[[optuna.trial.FrozenTrial], None] | None = None) -> int:
    """Claim and run trials until the budget is reached, or until a trial would not finish one epoch before the
    timeout or a one-budget run's search end (TrialRunner.next_trial_fits); returns how many this worker ran.

    A trial that fails is handed to runner.fail, which classifies the error (search/failures.py): the worker goes on
    after a config or memory failure (the trial counts), and stops otherwise, in one line for a store, the machine,
    or an interrupt (the trial is retried), with the traceback for a bug (the trial counts, the study halts).
    While the budget is full only because of running trials, the worker waits instead of exiting: a running trial
    whose worker died goes stale after the grace period and its retry still has to run.
    """
    ran = 0
    poll = min(WAIT_POLL_S, storage_of(study).get_heartbeat_interval() or WAIT_POLL_S)
    while True:
        raise_if_interrupted()
        check_halted(study)
        if not runner.next_trial_fits(study):  # the timeout or the search's end (runner.search_end)
            break
        trial = None
        try:
            trial = claim_trial(study, spec.n_trials)
            close_dead_runs(study, runner.tracker)  # the claim may have failed dead workers' trials
            if trial is None:
                if counted(study) >= spec.n_trials:
                    break
                time.sleep(poll)
                continue
            with Heartbeat(storage_of(study), trial_id(trial)):
                state, value = runner.run(trial)
            frozen = study.tell(trial, value, state=state)
        except BaseException as exc:
            frozen = fail_or_stop(study, runner, trial, exc)
        ran += 1
        if on_trial is not None:
            on_trial(frozen)
    return ran


def fail_or_stop(study: optuna.Study, runner: TrialRunner, trial: optuna.Trial | None,
                 exc: BaseException) -> optuna.trial.FrozenTrial:
    """The frozen failed trial when the worker goes on (search/failures.py GOES_ON); otherwise raises what stops it:
    the bug or interrupt itself, or a one-line error. An error while failing the trial is classified too."""
    frozen = None
    release_interrupted(exc)  # before failing the trial writes to the stores (a no-op unless `exc` is an interrupt)
    try:
        failure, frozen = runner.fail(study, trial, exc) if trial is not None else (classify(exc), None)
    except BaseException as inner:  # noqa: BLE001 - failing the trial failed too (the storage is gone): one error
        first = classify(exc)
        failure = first if first.kind in (Kind.BUG, Kind.INTERRUPT) else classify(inner)
    if failure.goes_on and frozen is not None:
        return frozen
    stop = failure.user_error(trial.number if trial is not None else None)
    if stop is failure.exc:
        raise stop
    raise stop from failure.exc


def check_halted(study: optuna.Study) -> None:
    """Raise StudyHalted when a worker of this study stopped on a bug (see TrialRunner.fail)."""
    reason = study_attrs(study).get(HALT_ATTR)
    if reason:
        raise StudyHalted(f"study '{study.study_name}' halted: {reason} (a bug, not the configuration: its traceback "
                          f"is in that worker's output; `study run` again resumes it)")


def cpu_threads(workers: int) -> int:
    """Split this machine's cores among local workers (at least one thread each)."""
    return max(1, usable_cores() // max(1, workers))


def study_dir(state_dir: str | Path, name: str) -> Path:
    """STATE/studies/<name>; the name is checked here too, so no caller can write outside the state directory."""
    return Path(state_dir) / "studies" / safe_name(name)


def dispose_study(study: optuna.Study) -> None:
    dispose(storage_of(study))
