"""The one-budget job's safe answers: a valid submission written in seconds and replaced only by a better one (the
closed-form ridge before the first trial, then the best trial's own checkpoint after the search), so that the job
ends with a submission whatever the search and the pick manage."""
from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import optuna

from search.failures import Kind, classify
from search.pick.candidates import fetch_checkpoint, top_trials
from search.pick.ensemble import predict_all
from search.study.report import load_existing_study
from search.study.storage import dispose, storage_of
from trainers.checkpoint import load_model
from trainers.closed_form import fit_ridge
from trainers.data import TestSet, TrainSet, check_text_dim
from trainers.errors import LatentsweepError
from trainers.submission import check_submission, write_submission

log = logging.getLogger("latentsweep")
# How often the keeper looks for a new best trial while the search runs: a demo trial takes 3-15 s on 2 cores, and a
# look (one storage read) costs milliseconds; rewriting the answer (one checkpoint's test predictions) about a second.
KEEP_POLL_S = 5.0


@dataclass(frozen=True)
class SafeAnswer:
    """A submission in place at `path`: what made it, and the seconds making it took on this machine."""
    path: Path
    source: str
    seconds: float


def put_submission(out: Path, test: TestSet, pred: np.ndarray) -> None:
    """Write the submission of `pred` [N_test, Di] for `test` to `out`: staged beside it, checked, then moved into
    place in one rename, so `out` is at every moment either the previous valid submission or the new one."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, staged = tempfile.mkstemp(prefix=f".{out.name}-", suffix=".csv", dir=out.parent)
    os.close(fd)
    try:
        write_submission(staged, test.ids, pred)
        check_submission(staged, test, dim=pred.shape[1])
        os.replace(staged, out)
    finally:
        Path(staged).unlink(missing_ok=True)


def ridge_answer(data: TrainSet, test: TestSet, out: Path) -> SafeAnswer:
    """The closed-form ridge's submission (trainers.closed_form): the job's floor, before any trial."""
    started = time.monotonic()
    check_text_dim(test, data.text.shape[1], "the training captions have")
    ridge, scores = fit_ridge(data)
    put_submission(out, test, ridge.predict(test.embeddings))
    held = f", held-out MRR {scores[ridge.alpha]:.4f}" if scores else ""
    return SafeAnswer(out, f"closed-form ridge (alpha {ridge.alpha:g}{held})", time.monotonic() - started)


def best_trial(study: optuna.Study) -> optuna.trial.FrozenTrial | None:
    """The study's best trial with a value (a pruned trial's best epoch counts), or None."""
    try:
        return top_trials(study, 1)[0]
    except LatentsweepError:  # no trial with a value yet
        return None


def trial_answer(trial: optuna.trial.FrozenTrial, root: Path, test: TestSet, out: Path, device) -> SafeAnswer | None:
    """`trial`'s own checkpoint's submission; None when its checkpoint is not on disk under `root` (nothing is
    downloaded: the job's trials wrote their checkpoints here)."""
    started = time.monotonic()
    found = fetch_checkpoint(trial, _NoTracker(), root, root)
    if found is None:
        return None
    model, _, _ = load_model(found[0], device)
    put_submission(out, test, predict_all([model], test.embeddings, device)[0])
    return SafeAnswer(out, f"trial {trial.number}'s checkpoint", time.monotonic() - started)


class Keeper:
    """Keeps the submission at `out` the best trial's answer while a search runs: a thread that looks at the study
    every KEEP_POLL_S and rewrites the answer when the best trial changed, so a job killed mid-search still leaves
    its best model's submission. `refresh()` does one look now (the job's last, after the search)."""

    def __init__(self, name: str, storage: str, root: Path, test: TestSet, out: Path, device, answer: SafeAnswer):
        self.name, self.storage, self.root, self.test, self.out, self.device = name, storage, root, test, out, device
        self.answer, self.number = answer, None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="latentsweep-keeper", daemon=True)

    def refresh(self) -> SafeAnswer:
        try:
            study = load_existing_study(self.name, self.storage)
        except LatentsweepError:  # not created yet: the search is starting
            return self.answer
        try:
            best = best_trial(study)
        finally:
            dispose(storage_of(study))
        if best is not None and best.number != self.number:
            made = trial_answer(best, self.root, self.test, self.out, self.device)
            if made is not None:
                self.answer, self.number = made, best.number
        return self.answer

    def _watch(self) -> None:
        warned = False
        while not self.stop.wait(KEEP_POLL_S):
            try:
                self.refresh()
            except Exception as exc:  # noqa: BLE001 - a thread cannot stop the job: said once, tried again
                if not warned:
                    failure = classify(exc)
                    log.warning("could not update the safe answer (%s); trying again every %.0f s",
                                failure.detail if failure.kind is Kind.BUG else failure.reason, KEEP_POLL_S)
                    warned = True

    def __enter__(self) -> "Keeper":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


class _NoTracker:
    """fetch_checkpoint's tracker for a local-only lookup: a trial whose best.pt is not on disk has no answer here."""

    def download_artifact(self, run_id: str, path: str, directory: Path) -> Path:
        raise FileNotFoundError(f"{path} of run {run_id}: the safe answer reads local checkpoints only")


__all__ = ["Keeper", "SafeAnswer", "best_trial", "put_submission", "ridge_answer", "trial_answer"]
