"""The Optuna objective as a thin adapter: sample knobs into the config, train, report/prune per epoch, track in MLflow."""
from __future__ import annotations

import functools
import logging
import subprocess
import traceback
from pathlib import Path

import optuna
from optuna.trial import TrialState

from search.space import sample
from search.storage import redact_url, retry_callback
from search.studyfile import StudyFile
from search.tracking import Tracker
from trainers.config import dump_toml, flatten, with_values
from trainers.data import TrainSet
from trainers.errors import LatentsweepError
from trainers.loop import EpochReport, train

log = logging.getLogger("latentsweep")
ERROR_ATTR = "latentsweep.error"  # set on trials that failed by themselves (not retried; they count in the budget)


@functools.lru_cache(maxsize=1)
def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                             text=True, timeout=5)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


class TrialRunner:
    """Runs one trial end to end; whatever happens, the MLflow run ends with the state Optuna records."""

    def __init__(self, sf: StudyFile, spec, data: TrainSet, tracker: Tracker, out_root: Path):
        self.sf, self.spec, self.data, self.tracker, self.out_root = sf, spec, data, tracker, out_root
        self.base_values = flatten(sf.base)

    def run(self, trial: optuna.Trial) -> tuple[TrialState, float | None]:
        values = sample(trial, list(self.sf.space), self.base_values)
        cfg = with_values(self.sf.base, {**values, "data.path": self.spec.data_path,
                                         "train.threads": self.spec.threads})
        out = self.out_root / f"trial-{trial.number}"
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.toml").write_text(dump_toml(cfg))
        run_id = self.tracker.start_trial(trial.number, {k: redact_url(str(v)) for k, v in flatten(cfg).items()},
                                          self._tags(trial, cfg))
        trial.set_user_attr("mlflow_run_id", run_id)
        trial.set_user_attr("out_dir", str(out))
        try:
            result = train(cfg, self.data, callback=functools.partial(self._report, trial, run_id), out_dir=out,
                           progress=self.spec.progress)
        except optuna.TrialPruned:
            self._close(run_id, out, "PRUNED")
            return TrialState.PRUNED, None
        except KeyboardInterrupt:
            self._close(run_id, out, "INTERRUPTED")
            raise
        except Exception as exc:  # a config that cannot train is a failed trial, not a dead study
            message = str(exc) if isinstance(exc, LatentsweepError) else traceback.format_exc(limit=3)
            trial.set_user_attr(ERROR_ATTR, message.strip().splitlines()[-1][:500])
            log.warning("trial %d failed: %s", trial.number, message.strip().splitlines()[-1])
            self._close(run_id, out, "FAIL", error=message)
            return TrialState.FAIL, None
        trial.set_user_attr("best_epoch", result.best_epoch)
        trial.set_user_attr("checkpoint", str(result.checkpoint))
        self._close(run_id, out, "COMPLETE", ranks=getattr(result, "val_ranks", None))
        return TrialState.COMPLETE, float(result.best_metrics[self.sf.objective])

    def _report(self, trial: optuna.Trial, run_id: str, report: EpochReport) -> None:
        if self.sf.objective not in report.metrics:
            raise LatentsweepError(f"objective '{self.sf.objective}' is not a logged metric; "
                                   f"available: {', '.join(k for k in report.metrics if k.startswith('val/'))}")
        self.tracker.log_epoch(run_id, report.metrics, report.epoch)
        trial.report(report.metrics[self.sf.objective], report.epoch)
        if trial.should_prune():
            raise optuna.TrialPruned(f"pruned at epoch {report.epoch}")

    def _tags(self, trial: optuna.Trial, cfg) -> dict[str, str]:
        # Optuna's retry callback marks the WAITING copy with system attr "failed_trial" = the retried number
        retry_of = trial.study._storage.get_trial_system_attrs(trial._trial_id).get("failed_trial")
        tags = {"optuna.trial_number": str(trial.number), "optuna.study": self.spec.name,
                "git_commit": git_commit(), "seed": str(cfg.train.seed), "data_fingerprint": self.data.fingerprint,
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
                from search.plots import rank_histogram

                self.tracker.log_figure(run_id, rank_histogram(ranks, f"{self.spec.name} trial {out.name}"),
                                        "rank_distribution.png")
        except Exception as exc:  # noqa: BLE001 - tracking must not change the trial's outcome
            log.warning("could not log artifacts of %s: %s", out.name, exc)
        finally:
            self.tracker.end_trial(run_id, state)

    def retry(self, study: optuna.Study, frozen: optuna.trial.FrozenTrial) -> None:
        """An interrupted trial is retried on resume, exactly like a trial whose worker died."""
        retry_callback(self.spec.storage.max_retry)(study, frozen)
