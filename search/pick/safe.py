"""The one-budget job's safe answers: a valid submission written in seconds and replaced only by a better one (the
closed-form ridge before the first trial, then the best trial's own checkpoint after the search), so that the job
ends with a submission whatever the search and the pick manage."""
from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import optuna

from search.pick.candidates import fetch_checkpoint, top_trials
from search.pick.ensemble import predict_all
from trainers.checkpoint import load_model
from trainers.closed_form import fit_ridge
from trainers.data import TestSet, TrainSet, check_text_dim
from trainers.errors import LatentsweepError
from trainers.submission import check_submission, write_submission


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


def best_trial_answer(study: optuna.Study, root: Path, test: TestSet, out: Path, device) -> SafeAnswer | None:
    """The best trial's own checkpoint's submission (a pruned trial's best epoch included); None when no trial has
    a value or a local checkpoint yet. Nothing is downloaded: the job's trials wrote their checkpoints here."""
    started = time.monotonic()
    try:
        best = top_trials(study, 1)[0]
    except LatentsweepError:  # no trial with a value yet
        return None
    local_only = _NoTracker()
    found = fetch_checkpoint(best, local_only, root, root)
    if found is None:
        return None
    model, _, _ = load_model(found[0], device)
    put_submission(out, test, predict_all([model], test.embeddings, device)[0])
    return SafeAnswer(out, f"trial {best.number}'s checkpoint", time.monotonic() - started)


class _NoTracker:
    """fetch_checkpoint's tracker for a local-only lookup: a trial whose best.pt is not on disk has no answer here."""

    def download_artifact(self, run_id: str, path: str, directory: Path) -> Path:
        raise FileNotFoundError(f"{path} of run {run_id}: the safe answer reads local checkpoints only")


__all__ = ["SafeAnswer", "best_trial_answer", "put_submission", "ridge_answer"]
