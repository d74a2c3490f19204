"""The one-budget job's safe answers: a valid submission written in seconds and replaced only by a better one (the
closed-form ridge before the first trial, then the best trial's own checkpoint after the search), so that the job
ends with a submission whatever the search and the pick manage."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import optuna

from latentsweep.search.failures import Kind, classify
from latentsweep.search.pick.candidates import share_data, top_trials
from latentsweep.search.pick.ensemble import predict_all
from latentsweep.search.pick.judge import Judge, Standing
from latentsweep.search.study.contract import ANSWER_ATTR, JUDGED_KEY, DamagedStudy, TrialOutputs
from latentsweep.search.study.report import load_existing_study
from latentsweep.search.study.storage import dispose, storage_of
from latentsweep.search.tracking.paths import resolve_in_state
from latentsweep.trainers.train.checkpoint import load_model
from latentsweep.trainers.models.closed_form import fit_ridge
from latentsweep.trainers.data.sets import TestSet, TrainSet, check_text_dim
from latentsweep.trainers.core.errors import LatentsweepError
from latentsweep.trainers.core.io import atomic_path
from latentsweep.trainers.core.progress import say
from latentsweep.trainers.eval.submission import check_submission, write_submission

# How often the keeper looks for a new best trial while the search runs: a demo trial takes 3-15 s on 2 cores, and a
# look (one storage read) costs milliseconds; rewriting the answer (one checkpoint's test predictions) about a second.
KEEP_POLL_S = 5.0


@dataclass(frozen=True)
class SafeAnswer:
    """A submission in place at `path`: what made it, and the seconds making it took on this machine."""
    path: Path
    source: str
    seconds: float
    alpha: float | None = None  # the closed-form floor's ridge strength (None: another answer)


def put_submission(out: Path, test: TestSet, pred: np.ndarray) -> None:
    """Write the submission of `pred` [N_test, Di] for `test` to `out`: staged beside it, checked, then moved into
    place in one rename (latentsweep.trainers.core.io.atomic_path), so `out` is at every moment either the previous
    valid submission
    or the new one."""
    with atomic_path(out) as staged:
        write_submission(staged, test.ids, pred)
        check_submission(staged, test, dim=pred.shape[1])


def ridge_answer(data: TrainSet, test: TestSet, out: Path) -> SafeAnswer:
    """The closed-form ridge's submission (latentsweep.trainers.models.closed_form): the job's floor, before any
    trial."""
    started = time.monotonic()
    check_text_dim(test, data.text.shape[1], "the training captions have")
    ridge, _ = fit_ridge(data)
    put_submission(out, test, ridge.predict(test.embeddings))
    return SafeAnswer(out, f"the closed-form ridge (alpha {ridge.alpha:g})", time.monotonic() - started, ridge.alpha)


def best_trial(study: optuna.Study) -> optuna.trial.FrozenTrial | None:
    """The study's best trial with a value (a pruned trial's best epoch counts), or None."""
    try:
        return top_trials(study, 1)[0]
    except DamagedStudy:  # not "no trial yet": the caller says it
        raise
    except LatentsweepError:  # no trial with a value yet
        return None


def local_checkpoint(trial: optuna.trial.FrozenTrial, root: Path, study: str | None = None) -> Path | None:
    """`trial`'s (of study `study`) best.pt on disk under the state directory `root`, or None (nothing is
    downloaded: the job's trials wrote their checkpoints here)."""
    local = TrialOutputs.of(trial, study).local_checkpoint
    path = resolve_in_state(local, root) if local else None
    return path if path is not None and path.is_file() else None


class Keeper:
    """Keeps the submission at `out` the best answer while a search runs: a thread that looks at the study every
    KEEP_POLL_S and, when the best trial (or its value) changed, scores its checkpoint on the judge's val split and
    rewrites the answer only when it beats the one in place (latentsweep.search.pick.judge; without a judge, any trial
    with a
    value replaces the floor), so a job killed mid-search still leaves its best answer. `refresh()` does one look now
    (the job's last, after the search). The keeper draws nothing from torch's global generator (its models are built
    on the meta device, latentsweep.trainers.train.checkpoint.load_model's rng_free) and opens the study's storage once."""

    def __init__(self, name: str, storage: str, root: Path, test: TestSet, out: Path, device, answer: SafeAnswer,
                 judge: Judge | None = None, standing: Standing | None = None, data: TrainSet | None = None):
        self.name, self.storage, self.root, self.test, self.out, self.device = name, storage, root, test, out, device
        self.data = data  # the job's loaded training data: what a knn checkpoint's keys are read from
        self.answer, self.judge = answer, judge
        self.standing = standing or Standing(answer.source, None)
        self.looked: set[tuple[int, float | None]] = set()  # (trial, value) already scored
        self.missing: set[int] = set()  # trials whose missing checkpoint was said (once each)
        # trial -> seconds its checkpoint took to load and score on the val split: what the pick pays per candidate
        # (the search's reserve reads them, latentsweep.search.study.budget)
        self.judged: dict[int, float] = {}
        self.study: optuna.Study | None = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="latentsweep-keeper", daemon=True)

    def _open(self) -> optuna.Study | None:
        """The study, opened once and kept (None while it does not exist yet: the search is starting)."""
        if self.study is None:
            try:
                self.study = load_existing_study(self.name, self.storage)
            except LatentsweepError:
                return None
        return self.study

    def close(self) -> None:
        """Close the study's storage (after the job's last look)."""
        if self.study is not None:
            dispose(storage_of(self.study))
            self.study = None

    def refresh(self) -> SafeAnswer:
        study = self._open()
        if study is None:
            return self.answer
        try:
            best = best_trial(study)
        except Exception:  # a store error: the next look opens the storage again
            self.close()
            raise
        if best is None or (best.number, best.value) in self.looked:
            return self.answer
        found = local_checkpoint(best, self.root, study.study_name)
        if found is None:
            if best.number not in self.missing:
                self.missing.add(best.number)
                say(f"latentsweep: warning: trial {best.number}'s checkpoint is not under {self.root} (yet): the "
                    "answer in place stays until it is")
            return self.answer
        self.looked.add((best.number, best.value))
        self._consider(best.number, found)
        if self.standing.score is not None:  # what the search's reserve compares its trials with (budget.py)
            study.set_user_attr(ANSWER_ATTR, {"source": self.standing.source, "val_mrr": self.standing.score,
                                              JUDGED_KEY: {str(n): s for n, s in self.judged.items()}})
        return self.answer

    def _consider(self, number: int, checkpoint: Path) -> None:
        """Score trial `number`'s checkpoint and put its answer in place when it beats the one there."""
        started = time.monotonic()
        model, _, meta = load_model(checkpoint, self.device, rng_free=True)
        if self.data is not None:
            share_data(model, self.data, meta.get("data_fingerprint"))
        source = f"trial {number}'s checkpoint"
        score = None if self.judge is None else self.judge.score_models([model], [1.0], self.device)
        self.judged[number] = time.monotonic() - started
        in_place = self.standing.source
        if not self.standing.offer(source, score):
            say(f"latentsweep: {self.standing.lost_line(source, score)}")
            return
        put_submission(self.out, self.test, predict_all([model], self.test.embeddings, self.device)[0])
        self.answer = SafeAnswer(self.out, source, time.monotonic() - started)
        if score is not None:
            say(f"latentsweep: {source} scores {score.mrr:.4f} MRR on the val split, above {in_place}: it is the "
                "answer now")

    def _watch(self) -> None:
        warned = False
        while not self.stop.wait(KEEP_POLL_S):
            try:
                self.refresh()
            except Exception as exc:  # noqa: BLE001 - a thread cannot stop the job: said once, tried again
                if not warned:
                    failure = classify(exc)
                    why = failure.detail if failure.kind is Kind.BUG else failure.reason
                    say(f"could not update the safe answer ({why}); trying again every {KEEP_POLL_S:.0f} s")
                    warned = True

    def __enter__(self) -> "Keeper":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


__all__ = ["Keeper", "SafeAnswer", "best_trial", "local_checkpoint", "put_submission", "ridge_answer"]
