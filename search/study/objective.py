"""The Optuna objective as a thin adapter: sample knobs into the config, train, report/prune per epoch, track in MLflow."""
from __future__ import annotations

import functools
import logging
import traceback
from pathlib import Path

import optuna
import torch
from optuna.trial import TrialState

from search.study.progress import emit
from search.study.space import sample
from search.study.storage import redact_url, retry_callback
from search.study.studyfile import StudyFile
from search.tracking.base import (
    BEST_EPOCH_METRIC, NOTE_TAG, SEARCH_PARAM_PREFIX, SEARCHED_TAG, DatasetRecord, Tracker, best_metric, source_tags,
)
from search.tracking.plots import rank_histogram
from trainers.config import dump_toml, flatten, with_values
from trainers.data import TrainSet
from trainers.errors import LatentsweepError
from trainers.io import atomic_write
from trainers.loop import DeadlineReached, EpochReport, train

log = logging.getLogger("latentsweep")
ERROR_ATTR = "latentsweep.error"  # set on trials that failed by themselves (not retried; they count in the budget)
# A study user attr, set when a bug stopped a worker: the other workers stop before claiming their next trial.
HALT_ATTR = "latentsweep.halted"
# Trial user attrs: the run's measured seconds (trainers.cost.Timing as a dict), what the pick plans its jobs and a
# one-budget run its split with; and, on a trial the deadline cut short, where it stopped.
TIMING_ATTR = "timing"
DEADLINE_ATTR = "latentsweep.stopped_at_deadline"
# What a configuration can do to a trial: a user-facing error (a bad value found at run time, divergence is a
# TrainingDiverged) or running out of memory. Anything else raised by train() is a bug in our code: it stops the
# study loudly instead of failing every trial in turn and burning the budget.
EXPECTED = (LatentsweepError, torch.OutOfMemoryError, MemoryError)


class StoreFailed(LatentsweepError):
    """The tracking store or the storage failed during a trial: the worker stops in one line, the trial is retried."""


class StudyHalted(Exception):
    """Another worker of this study stopped on a bug: this one stops before claiming a trial (not a user error)."""


def relative_to_state(path: Path, state_dir: str | Path) -> str:
    """`path` relative to the state directory when inside it (the directory can then move), else absolute."""
    try:
        return Path(path).resolve().relative_to(Path(state_dir).resolve()).as_posix()
    except ValueError:
        return str(Path(path).resolve())


class TrialRunner:
    """Runs one trial end to end; whatever happens, the MLflow run ends with the state Optuna records."""

    def __init__(self, study_file: StudyFile, spec, data: TrainSet, tracker: Tracker, out_root: Path):
        self.study_file, self.spec, self.data, self.tracker, self.out_root = study_file, spec, data, tracker, out_root
        self.base_values = flatten(study_file.base)
        self.open_run: str | None = None  # the MLflow run of the trial in progress, until it is closed
        self.bug: str | None = None  # the traceback of a bug raised by train() in the trial in progress
        # A one-budget run's search end (time.time()), re-estimated after every epoch (search.study.budget)
        self.search_end: float | None = None

    def search_end_now(self, study: optuna.Study) -> float | None:
        """Re-estimate when the search must end (None outside a one-budget run)."""
        budget = self.spec.budget
        self.search_end = None if budget is None else budget.search_end(study, len(self.data.cap2img),
                                                                        len(self.data.image))
        return self.search_end

    def run(self, trial: optuna.Trial) -> tuple[TrialState, float | None]:
        """Run the trial; in a one-budget run its training stops at the search's end, keeping its best epoch."""
        cfg, out, run_id = self._start(trial)
        try:
            result = train(cfg, self.data, callback=functools.partial(self._report, trial, run_id, {}), out_dir=out,
                           progress=self.spec.progress, deadline=lambda: self.search_end)
        except optuna.TrialPruned as exc:
            self.tracker.set_tags(run_id, {NOTE_TAG: f"Pruned by the study's pruner ({exc})."})
            self._close(run_id, out, "PRUNED")
            return TrialState.PRUNED, None
        except DeadlineReached as exc:  # the budget's end, before any epoch ended: nothing to keep, not a failure
            trial.set_user_attr(DEADLINE_ATTR, str(exc))
            self.tracker.set_tags(run_id, {NOTE_TAG: f"Stopped at the run's deadline: {exc}."})
            self._close(run_id, out, "PRUNED")
            return TrialState.PRUNED, None
        except KeyboardInterrupt:
            self._close(run_id, out, "INTERRUPTED")
            raise
        except (OSError, StoreFailed):  # the machine's, not the config's: abandon() fails and retries the trial
            raise
        except EXPECTED as exc:  # a config that cannot train is a failed trial, not a dead study
            message = str(exc) if isinstance(exc, LatentsweepError) else f"{type(exc).__name__}: {exc}"
            trial.set_user_attr(ERROR_ATTR, message.strip().splitlines()[-1][:500])
            log.warning("trial %d failed: %s", trial.number, message.strip().splitlines()[-1])
            self._close(run_id, out, "FAIL", error=message)
            return TrialState.FAIL, None
        except Exception:  # our bug: abandon() fails the trial for good and halts the study, then the worker stops
            self.bug = traceback.format_exc()
            raise
        value = float(result.best_metrics[self.study_file.objective])
        if result.stopped_at_deadline:
            # Cut short by the budget, its best finished epoch kept: pruned (Optuna's "stopped early"), and pick
            # still finds its best epoch's checkpoint and value.
            trial.set_user_attr(DEADLINE_ATTR, f"stopped after epoch {len(result.history) - 1}")
            self.tracker.set_tags(run_id, {NOTE_TAG: f"Stopped at the run's deadline after epoch "
                                                     f"{len(result.history) - 1}; best epoch {result.best_epoch} "
                                                     f"({self.study_file.objective} {value:.4f}) kept in best.pt."})
            self._close(run_id, out, "PRUNED")
            return TrialState.PRUNED, None
        trial.set_user_attr("best_epoch", result.best_epoch)
        trial.set_user_attr("checkpoint", relative_to_state(result.checkpoint, self.spec.state_dir))
        self.tracker.set_tags(run_id, {NOTE_TAG: f"Complete: {self.study_file.objective} {value:.4f} at epoch "
                                                 f"{result.best_epoch} (the best epoch; its checkpoint is best.pt)."})
        self._close(run_id, out, "COMPLETE", ranks=getattr(result, "val_ranks", None))
        return TrialState.COMPLETE, value

    def _start(self, trial: optuna.Trial):
        """Sample the config, write trial-N/config.toml and open the MLflow run.

        A failure here is not the config's fault (a full disk, a name too long for the file system, a space whose
        distributions differ from the stored trials'): it raises a one-line error and the caller fails and retries
        the trial. `self.open_run` names the run until it is closed, so every exit path can close it.
        """
        out = self.out_root / f"trial-{trial.number}"
        try:
            values = sample(trial, list(self.study_file.space), self.base_values)
        except ValueError as exc:
            raise LatentsweepError(f"trial {trial.number}: cannot sample the search space: {exc}") from None
        cfg = with_values(self.study_file.base, {**values, "data.path": self.spec.data_path,
                                                 "train.threads": self.spec.threads})
        try:
            out.mkdir(parents=True, exist_ok=True)
            with atomic_write(out / "config.toml") as fh:
                fh.write(dump_toml(cfg))
        except OSError as exc:
            raise LatentsweepError(f"trial {trial.number}: cannot write {exc.filename or out}: "
                                   f"{exc.strerror or exc}") from None
        params = {k: redact_url(str(v)) for k, v in flatten(cfg).items()}
        params.update({f"{SEARCH_PARAM_PREFIX}{k}": redact_url(str(v)) for k, v in values.items()})
        self.open_run = self.tracker.start_trial(trial.number, params, self._tags(trial, cfg))
        trial.set_user_attr("mlflow_run_id", self.open_run)
        trial.set_user_attr("out_dir", relative_to_state(out, self.spec.state_dir))
        self.tracker.log_dataset(self.open_run, DatasetRecord(
            Path(self.spec.data_path).name, self.data.fingerprint, self.spec.data_path, "train",
            {"images": int(self.data.image.shape[0]), "captions": int(self.data.text.shape[0]),
             "text_dim": int(self.data.text.shape[1]), "image_dim": int(self.data.image.shape[1])}))
        return cfg, out, self.open_run

    def abandon(self, study: optuna.Study, trial: optuna.Trial) -> None:
        """The worker stops inside this trial (Ctrl-C, SIGTERM, any error): close its run, fail it, queue its retry.

        After a bug in train() (self.bug) the trial is failed for good instead (its run FAILED with the traceback),
        and the study is marked halted so that the other workers stop too.

        Each step is attempted even if an earlier one fails, so a broken tracking server cannot leave the trial
        RUNNING in Optuna and a broken storage cannot leave the run RUNNING in MLflow.
        """
        run_id, self.open_run = self.open_run, None
        bug, self.bug = self.bug, None
        if run_id is not None:
            try:
                if bug:
                    self._close(run_id, self.out_root / f"trial-{trial.number}", "FAIL", error=bug)
                else:
                    self.tracker.end_trial(run_id, "INTERRUPTED")
            except Exception as exc:  # noqa: BLE001 - the Optuna side must still be closed
                log.warning("could not close the MLflow run of trial %d: %s", trial.number, exc)
        if not bug:
            self.retry(study, study.tell(trial, state=TrialState.FAIL))
            return
        reason = bug.strip().splitlines()[-1][:500]
        try:  # retrying would hit the same bug: the trial counts, and the other workers stop before their next one
            trial.set_user_attr(ERROR_ATTR, reason)
            study.set_user_attr(HALT_ATTR, f"trial {trial.number} raised {reason}")
        finally:
            study.tell(trial, state=TrialState.FAIL)

    def _report(self, trial: optuna.Trial, run_id: str, best: dict, report: EpochReport) -> None:
        """Log the epoch, report it to the pruner. `best` (per trial) holds the best epoch so far: its objective
        is logged each epoch as best/<objective>, so its last value is the trial's value in Optuna."""
        if self.study_file.objective not in report.metrics:
            raise LatentsweepError(f"objective '{self.study_file.objective}' is not a logged metric; "
                                   f"available: {', '.join(k for k in report.metrics if k.startswith('val/'))}")
        if report.improved or not best:  # the loop keeps the checkpoint of the improved epochs
            best.update({best_metric(self.study_file.objective): report.metrics[self.study_file.objective],
                         BEST_EPOCH_METRIC: report.epoch})
        try:
            self.tracker.log_epoch(run_id, {**report.metrics, **best}, report.epoch)
            trial.report(report.metrics[self.study_file.objective], report.epoch)
            if report.timing is not None:
                trial.set_user_attr(TIMING_ATTR, report.timing.as_attrs())
            if self.spec.budget is not None:  # this epoch measured more: the pick's reserve may have changed
                self.search_end_now(trial.study)
        except Exception as exc:  # a store that failed is neither the config's fault nor a bug: stop, retry later
            reason = (str(exc).strip().splitlines() or [""])[0][:300]
            raise StoreFailed(f"trial {trial.number}: cannot record epoch {report.epoch} "
                              f"({type(exc).__name__}: {redact_url(reason)})") from exc
        if self.spec.verbose and not self.spec.progress:  # with bars, the epoch bar shows it
            objective = self.study_file.objective
            emit(f"study {self.spec.name} trial {trial.number} epoch {report.epoch} {objective} "
                 f"{report.metrics[objective]:.4f}" + (" (best epoch so far)" if report.improved else ""))
        if trial.should_prune():
            raise optuna.TrialPruned(f"pruned at epoch {report.epoch}")

    def _tags(self, trial: optuna.Trial, cfg) -> dict[str, str]:
        # Optuna's retry callback marks the WAITING copy with system attr "failed_trial" = the retried number
        retry_of = trial.study._storage.get_trial_system_attrs(trial._trial_id).get("failed_trial")
        tags = {"optuna.trial_number": str(trial.number), "optuna.study": self.spec.name,
                **source_tags(f"latentsweep study {self.spec.name} ({Path(self.spec.study_file).name})"),
                SEARCHED_TAG: ",".join(p.key for p in self.study_file.space),
                "seed": str(cfg.train.seed), "data_fingerprint": self.data.fingerprint,
                "data_path": self.spec.data_path, "optuna.state": "RUNNING"}
        if retry_of is not None:
            tags["latentsweep.retry_of"] = str(retry_of)
        return tags

    def _close(self, run_id: str, out: Path, state: str, ranks=None, error: str | None = None) -> None:
        """Log whatever artifacts exist, then end the run; never leaves it RUNNING (artifact errors are logged)."""
        try:
            if error:
                self.tracker.set_tags(run_id, {"latentsweep.error": error[-4000:]})
            paths = [p for p in (out / "config.toml", out / "metrics.csv", out / "best.pt") if p.exists()]
            self.tracker.log_artifacts(run_id, paths)
            if ranks is not None:
                self.tracker.log_figure(run_id, rank_histogram(ranks, f"{self.spec.name} {out.name}"),
                                        "rank_distribution.png")
        except Exception as exc:  # noqa: BLE001 - tracking must not change the trial's outcome
            log.warning("could not log artifacts of %s: %s", out.name, exc)
        finally:
            self.tracker.end_trial(run_id, state)
            self.open_run = None

    def retry(self, study: optuna.Study, frozen: optuna.trial.FrozenTrial) -> None:
        """An interrupted trial is retried on resume, exactly like a trial whose worker died."""
        retry_callback(self.spec.storage.max_retry)(study, frozen)
