"""The Optuna objective as a thin adapter: sample knobs into the config, train, report/prune per epoch, track in
MLflow."""
from __future__ import annotations

import functools
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import optuna
from optuna.storages import RetryFailedTrialCallback
from optuna.trial import TrialState

from latentsweep.search.failures import (
    Failure, Kind, MachineFailed, StoreFailed, best_effort, classify, first_line, kind_of,
)
from latentsweep.search.study.contract import (
    DEADLINE_ATTR, DEVICE_ATTR, ERROR_ATTR, HALT_ATTR, POPULATION_ATTR, SIDE_ATTR, TIMING_ATTR, TrialOutputs,
    read_side, read_timing, read_trials,
)
from latentsweep.search.study.space import sample
from latentsweep.search.process import raise_if_interrupted
from latentsweep.search.redact import redact_url
from latentsweep.search.study.storage import retry_callback, storage_of, trial_id
from latentsweep.search.study.studyfile import StudyFile
from latentsweep.search.study.warm import warm_tags
from latentsweep.search.tracking.base import (
    BEST_EPOCH_METRIC, NOTE_TAG, SEARCH_PARAM_PREFIX, SEARCHED_TAG, DatasetRecord, Tracker, best_metric,
)
from latentsweep.search.tracking.source import source_tags
from latentsweep.search.tracking.plots import rank_histogram
from latentsweep.trainers.config.tree import Config, dump_toml, flatten, with_values
from latentsweep.trainers.data.sets import TrainSet
from latentsweep.trainers.core.deadline import Deadline
from latentsweep.trainers.core.errors import LatentsweepError
from latentsweep.trainers.core.devices import machine_gpu, resolve_device
from latentsweep.trainers.core.io import atomic_write
from latentsweep.trainers.train.loop import DeadlineReached, EpochReport, train
from latentsweep.trainers.core.progress import say

# Attempts to end a trial's MLflow run before the failure is warned about and left to the reaper (see _end).
CLOSE_ATTEMPTS = 2


@dataclass(frozen=True)
class Started:
    """A trial whose config is written and whose MLflow run is open: what training it needs, and its epoch callback
    (TrialRunner._report: the run's metrics, Optuna's report and pruning)."""
    cfg: Config
    out: Path
    run_id: str
    callback: Callable[[EpochReport], None]


def relative_to_state(path: Path, state_dir: str | Path) -> str:
    """`path` relative to the state directory when inside it (the directory can then move), else absolute."""
    try:
        return Path(path).resolve().relative_to(Path(state_dir).resolve()).as_posix()
    except ValueError:
        return str(Path(path).resolve())


def typical_trial_s(study: optuna.Study) -> float | None:
    """The median measured seconds of one trial's setup, first epoch and its validation (None before any). Side trials
    (latentsweep.search.study.side: the knn model, built once beside the search) are not typical of what is claimed
    next: at challenge size the knn's 266 s on 2 cores ended a `run --time 1200` search before its first MLP trial."""
    seconds = []
    for t in read_trials(study):
        timing = read_timing(t, study.study_name)
        if timing is not None and read_side(t, study.study_name) is None:
            seconds.append(timing.setup_s + timing.train_s + timing.eval_s)
    return statistics.median(seconds) if seconds else None


class TrialRunner:
    """Runs one trial end to end; whatever happens, the MLflow run ends with the state Optuna records."""

    def __init__(self, study_file: StudyFile, spec, data: TrainSet, tracker: Tracker, out_root: Path):
        self.study_file, self.spec, self.data, self.tracker, self.out_root = study_file, spec, data, tracker, out_root
        self.base_values = flatten(study_file.base)
        self.open_runs: dict[int, str] = {}  # trial number -> its MLflow run, from its start until it is closed
        # `study run --timeout`: from this worker's start; a one-budget run's search end is re-estimated after every
        # epoch (latentsweep.search.study.budget). The sooner of the two is the search's end
        # (latentsweep.trainers.core.deadline).
        self.timeout_end = Deadline.after(spec.timeout)  # Deadline.never() without a timeout
        self.search_end = self.timeout_end
        self.close_s = 0.0  # what closing this worker's last trial took (artifacts, figure, end of its run)

    def search_end_now(self, study: optuna.Study) -> Deadline:
        """Re-estimate when the search must end (Deadline.never() without a timeout or a one-budget run)."""
        budget = self.spec.budget
        end = Deadline.never() if budget is None else budget.search_end(study, len(self.data.cap2img),
                                                                        len(self.data.image))
        self.search_end = end.sooner(self.timeout_end)
        return self.search_end

    def next_trial_fits(self, study: optuna.Study) -> bool:
        """Whether a trial claimed now would finish one epoch before the search's end: the measured setup, epoch and
        validation of the study's typical trial (the median) plus this worker's last close. Start nothing that
        cannot finish: a trial cut before its first validation is time thrown away."""
        end = self.search_end_now(study)
        if not end.bounded:
            return True
        return end.fits(typical_trial_s(study) + self.close_s if typical_trial_s(study) is not None else None)

    def run(self, trial: optuna.Trial) -> tuple[TrialState, float | None]:
        """COMPLETE or PRUNED; any failure (from sampling to recording the result) is raised, for fail(). In a
        one-budget run the training stops at the search's end, keeping its best finished epoch. A population
        (latentsweep.search.study.population) uses the same pieces: start, the started trial's callback, finish."""
        started = self.start(trial)
        try:
            end = train(started.cfg, self.data, callback=started.callback, out_dir=started.out,
                        progress=self.spec.progress, deadline=self.deadline)
        except (optuna.TrialPruned, DeadlineReached) as exc:
            # finished inside the except clause, whose end drops `exc`: kept in a local, it and its traceback (the
            # run's frames: model, optimiser state, task) would form a cycle with this frame, freed only by Python's
            # next full collection, under the next trial
            return self.finish(trial, started, exc)
        # Without the model (it is in best.pt): a library's cyclic garbage made while the run closes (matplotlib's
        # parser keeps exception tracebacks) keeps this frame alive until the next full collection, and with the
        # model the knn side trial's keys (0.5 GB at challenge size) stayed under the next trial and the pick.
        end = replace(end, model=None)
        return self.finish(trial, started, end)

    def deadline(self) -> Deadline:
        """What training reads before every step: the search's end as last re-estimated (search_end_now)."""
        return self.search_end

    def start(self, trial: optuna.Trial, population: dict | None = None) -> Started:
        """Sample the trial's config, write it and open its MLflow run (see configure and open)."""
        return self.open(trial, *self.configure(trial), population=population)

    def finish(self, trial: optuna.Trial, started: Started, end) -> tuple[TrialState, float | None]:
        """A started trial's end (its TrainResult, or the exception that ended it) recorded and its run closed:
        COMPLETE or PRUNED (the pruner, or the deadline before any epoch ended); any other exception is raised,
        for fail()."""
        run_id, out = started.run_id, started.out
        if isinstance(end, (optuna.TrialPruned, DeadlineReached)):
            end = type(end)(str(end))  # the reason alone: the caught one's traceback holds the run's frames (see run)
        if isinstance(end, optuna.TrialPruned):
            self.tracker.log(run_id, tags={NOTE_TAG: f"Pruned by the study's pruner ({end})."})
            self._close(run_id, out, "PRUNED")
            return TrialState.PRUNED, None
        if isinstance(end, DeadlineReached):  # the budget's end, before any epoch ended: nothing to keep, no failure
            trial.set_user_attr(DEADLINE_ATTR, str(end))
            self.tracker.log(run_id, tags={NOTE_TAG: f"Stopped at the run's deadline: {end}."})
            self._close(run_id, out, "PRUNED")
            return TrialState.PRUNED, None
        if isinstance(end, BaseException):
            raise end
        result = end
        value = float(result.best_metrics[self.study_file.objective])
        if result.stopped_at_deadline:
            # Cut short by the budget, its best finished epoch kept: pruned (Optuna's "stopped early"), and pick
            # still finds its best epoch's checkpoint and value.
            trial.set_user_attr(DEADLINE_ATTR, f"stopped after epoch {len(result.history) - 1}")
            self.tracker.log(run_id, tags={NOTE_TAG: f"Stopped at the run's deadline after epoch "
                                                     f"{len(result.history) - 1}; best epoch {result.best_epoch} "
                                                     f"({self.study_file.objective} {value:.4f}) kept in best.pt."})
            self._close(run_id, out, "PRUNED")
            return TrialState.PRUNED, None
        TrialOutputs(checkpoint=relative_to_state(result.checkpoint, self.spec.state_dir),
                     best_epoch=result.best_epoch).record(trial)
        self.tracker.log(run_id, tags={NOTE_TAG: f"Complete: {self.study_file.objective} {value:.4f} at epoch "
                                                 f"{result.best_epoch} (the best epoch; its checkpoint is best.pt)."})
        self._close(run_id, out, "COMPLETE", ranks=getattr(result, "val_ranks", None))
        return TrialState.COMPLETE, value

    def configure(self, trial: optuna.Trial) -> tuple:
        """Sample the config and write trial-N/config.toml: (cfg, out, the sampled values, a side trial's values).

        A search space whose distributions differ from the stored trials' is a config error (the trial counts); a
        file system that refuses the config (full, read-only, a name too long) is the machine's (MachineFailed: the
        trial is retried).
        """
        out = self.out_root / f"trial-{trial.number}"
        side = read_side(trial)  # a side trial's config is its own values: it samples nothing
        try:
            values = side if side is not None else sample(trial, list(self.study_file.space), self.base_values)
        except ValueError as exc:
            raise LatentsweepError(f"cannot sample the search space: {exc}") from None
        cfg = with_values(self.study_file.base, {**values, "data.path": self.spec.data_path,
                                                 "train.threads": self.spec.threads})
        try:
            out.mkdir(parents=True, exist_ok=True)
            with atomic_write(out / "config.toml") as fh:
                fh.write(dump_toml(cfg))
        except OSError as exc:
            raise MachineFailed(f"cannot write {exc.filename or out}: {exc.strerror or exc}") from exc
        return cfg, out, values, side

    def open(self, trial: optuna.Trial, cfg, out: Path, values: dict, side: dict | None,
             population: dict | None = None) -> Started:
        """Open the trial's MLflow run (params, tags, dataset); `population` (POPULATION_ATTR's value) when it trains
        in one. `self.open_runs` names the run until it is closed, so fail() can close it."""
        params = {k: redact_url(str(v)) for k, v in flatten(cfg).items()}
        if side is None:  # search.<knob>: what the sampler chose (a side trial's values are in its side tag)
            params.update({f"{SEARCH_PARAM_PREFIX}{k}": redact_url(str(v)) for k, v in values.items()})
        run_id = self.tracker.start_trial(trial.number, params, self._tags(trial, cfg, population))
        self.open_runs[trial.number] = run_id
        TrialOutputs(mlflow_run_id=run_id, out_dir=relative_to_state(out, self.spec.state_dir)).record(trial)
        self.tracker.log_dataset(run_id, DatasetRecord(
            Path(self.spec.data_path).name, self.data.fingerprint, self.spec.data_path, "train",
            {"images": int(self.data.image.shape[0]), "captions": int(self.data.text.shape[0]),
             "text_dim": int(self.data.text.shape[1]), "image_dim": int(self.data.image.shape[1])}))
        return Started(cfg, out, run_id, functools.partial(self._report, trial, run_id, {}))

    def fail(self, study: optuna.Study, trial: optuna.Trial,
             exc: BaseException) -> tuple[Failure, optuna.trial.FrozenTrial]:
        """The trial raised `exc` (anywhere from sampling to recording its result): classify it once, close its run,
        tell Optuna FAIL once, and queue its retry or mark it counted (latentsweep.search.failures says which; a bug
        also marks
        the study halted, so the other workers stop). The Optuna outcome is decided by `exc` alone: a tracker that
        cannot close the run is said in one line (`study reap` closes it later), unless that is a bug of its own."""
        failure = classify(exc)
        run_id = self.open_runs.pop(trial.number, None)
        if run_id is not None:
            failure = self._close_failed(trial, run_id, failure)
        if failure.goes_on:
            say(f"trial {trial.number} failed: {failure.reason}")
        try:
            if failure.counts:
                trial.set_user_attr(ERROR_ATTR, failure.reason)
            if failure.kind is Kind.BUG:  # retrying would hit the same bug: the other workers stop before their next
                study.set_user_attr(HALT_ATTR, f"trial {trial.number} raised {failure.reason}")
        finally:
            frozen = study.tell(trial, state=TrialState.FAIL)
        if failure.retried:
            self.retry(study, frozen)
        return failure, frozen

    def _close_failed(self, trial: optuna.Trial, run_id: str, failure: Failure) -> Failure:
        """End the run of a failed trial (KILLED for an interrupt, else FAILED with the error); a bug raised while
        closing it replaces the trial's failure (it would hit every trial), any other error is warned about."""
        state = "INTERRUPTED" if failure.kind is Kind.INTERRUPT else "FAIL"
        try:
            self._close(run_id, self.out_root / f"trial-{trial.number}", state, error=failure.detail)
        except BaseException as exc:  # noqa: BLE001 - classified: a bug is kept, the rest said in one line
            closing = classify(exc)
            if closing.kind is Kind.BUG and failure.kind is not Kind.BUG:
                return closing
            say(f"could not close the MLflow run of trial {trial.number} ({closing.reason}); `latentsweep study reap` "
                "closes it")
        return failure

    def _report(self, trial: optuna.Trial, run_id: str, best: dict, report: EpochReport) -> None:
        """Log the epoch, report it to the pruner. `best` (per trial) holds the best epoch so far: its objective
        is logged each epoch as best/<objective>, so its last value is the trial's value in Optuna."""
        raise_if_interrupted()  # a Ctrl-C whose KeyboardInterrupt a finalizer swallowed stops the trial here
        if self.study_file.objective not in report.metrics:
            raise LatentsweepError(f"objective '{self.study_file.objective}' is not a logged metric; "
                                   f"available: {', '.join(k for k in report.metrics if k.startswith('val/'))}")
        if report.improved or not best:  # the loop keeps the checkpoint of the improved epochs
            best.update({best_metric(self.study_file.objective): report.metrics[self.study_file.objective],
                         BEST_EPOCH_METRIC: report.epoch})
        try:
            self.tracker.log(run_id, metrics={**report.metrics, **best}, step=report.epoch)
            trial.report(report.metrics[self.study_file.objective], report.epoch)
            if report.timing is not None:
                trial.set_user_attr(TIMING_ATTR, report.timing.as_attrs())
            if self.spec.budget is not None:  # this epoch measured more: the pick's reserve may have changed
                self.search_end_now(trial.study)
        except Exception as exc:  # an outage gets the epoch in its one line; anything else keeps its class
            if kind_of(exc) is not Kind.OUTAGE:
                raise
            raise StoreFailed(f"cannot record epoch {report.epoch} ({first_line(exc)})") from exc
        if self.spec.verbose and not self.spec.progress:  # with bars, the epoch bar shows it
            objective = self.study_file.objective
            say(f"study {self.spec.name} trial {trial.number} epoch {report.epoch} {objective} "
                f"{report.metrics[objective]:.4f}" + (" (best epoch so far)" if report.improved else ""))
        if trial.should_prune():
            raise optuna.TrialPruned(f"pruned at epoch {report.epoch}")

    def _tags(self, trial: optuna.Trial, cfg, population: dict | None = None) -> dict[str, str]:
        # Optuna's retry callback marks the WAITING copy with the retried number (read by its public static method)
        retry_of = RetryFailedTrialCallback.retried_trial_number(storage_of(trial.study).get_trial(trial_id(trial)))
        tags = {"optuna.trial_number": str(trial.number), "optuna.study": self.spec.name,
                **source_tags(f"latentsweep study {self.spec.name} ({Path(self.spec.study_file).name})"),
                SEARCHED_TAG: ",".join(p.key for p in self.study_file.space),
                "seed": str(cfg.train.seed), "data_fingerprint": self.data.fingerprint,
                "data_path": self.spec.data_path, "optuna.state": "RUNNING",
                DEVICE_ATTR: machine_gpu(resolve_device(cfg.train.device))}
        trial.set_user_attr(DEVICE_ATTR, tags[DEVICE_ATTR])  # `study status` reads Optuna, not MLflow
        if retry_of is not None:
            tags["latentsweep.retry_of"] = str(retry_of)
        if population is not None:  # which population it trained in, and its size (latentsweep.search.study.population)
            trial.set_user_attr(POPULATION_ATTR, population)
            tags.update({POPULATION_ATTR: str(population["id"]), f"{POPULATION_ATTR}_size": str(population["size"])})
        if SIDE_ATTR in trial.user_attrs:  # the stored text as it is (read_side parses it)
            tags[SIDE_ATTR] = str(trial.user_attrs[SIDE_ATTR])
        # a warm-started trial names its source study and trial (latentsweep.search.study.warm)
        tags.update(warm_tags(trial))
        return tags

    def _close(self, run_id: str, out: Path, state: str, ranks=None, error: str | None = None) -> None:
        """Log whatever artifacts exist, then end the run. An artifact that cannot be logged (a store outage, a full
        disk) is warned about and the run still ends; a bug there is raised, after the run ended."""
        started = time.monotonic()
        try:
            with best_effort(f"log the artifacts of {out.name}"):
                if error:
                    self.tracker.log(run_id, tags={ERROR_ATTR: error[-4000:]})  # the run's tag of the same name
                paths = [p for p in (out / "config.toml", out / "metrics.csv", out / "best.pt") if p.exists()]
                self.tracker.log_artifacts(run_id, paths)
                if ranks is not None:
                    self.tracker.log_figure(run_id, rank_histogram(ranks, f"{self.spec.name} {out.name}"),
                                            "rank_distribution.png")
        finally:
            try:
                self._end(run_id, state)
                self.open_runs = {n: r for n, r in self.open_runs.items() if r != run_id}
            finally:
                self.close_s = time.monotonic() - started

    def _end(self, run_id: str, state: str) -> None:
        """End the run, a second time when the first attempt failed with anything but a bug: an interrupt (Ctrl-C)
        that landed inside a store call can leave that connection unusable for the next call, and the pool then
        hands out a fresh one. A second failure is raised to the caller, which warns (`study reap` closes it)."""
        for attempt in range(CLOSE_ATTEMPTS):
            try:
                self.tracker.end_trial(run_id, state)
                return
            except Exception as exc:
                if kind_of(exc) is Kind.BUG or attempt == CLOSE_ATTEMPTS - 1:
                    raise  # else the next attempt; the last one's failure is raised

    def retry(self, study: optuna.Study, frozen: optuna.trial.FrozenTrial) -> None:
        """A trial failed by the machine, a store or an interrupt is retried, exactly like a trial whose worker died
        (Optuna's retry callback: at most StorageSettings.max_retry times)."""
        retry_callback(self.spec.storage.max_retry)(study, frozen)
