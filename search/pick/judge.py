"""The held-out images every candidate answer of a `latentsweep run` job is scored on (the closed-form floor, each
trial's checkpoint, the pick's ensemble), so an answer is replaced only by a better one on the same images, and the
standings the manifest records (which answer won, by how much)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from latentsweep.trainers.core.pages import take
from latentsweep.search.pick.ensemble import caption_rows, predicted_rows
from latentsweep.trainers.models.closed_form import held_out_rr, moments, solve
from latentsweep.trainers.config.tree import Config
from latentsweep.trainers.data.sets import TrainSet
from latentsweep.trainers.eval.metrics import GALLERY_SIZE, leaderboard_ranks
from latentsweep.trainers.data.splits import captions_and_local_images, captions_of
from latentsweep.trainers.train.tasks import split_images


# An answer replaces the one in place only when its mean gain per val image exceeds this many standard errors of
# that paired gain: the one-sided 95% point of the normal distribution. A gain inside the val split's noise is not
# taken: on a demo holdout's 120 val images a trial 0.006 above the floor there scored 0.033 below it on the test
# images (benchmarks/warm_start.py, holdout 3 at 120 s, 2026-11-27).
Z_BETTER = 1.645


@dataclass(frozen=True)
class Score:
    """An answer's val MRR and each val image's mean reciprocal rank over its captions: the unit two answers are
    paired on (an image's captions are not independent of each other)."""
    mrr: float
    per_image: np.ndarray  # float64 [Nv]


def gain(new: Score, old: Score) -> tuple[float, float]:
    """(mean paired gain of `new` over `old` per val image, its standard error; 0 with fewer than 2 images)."""
    d = new.per_image - old.per_image
    se = float(d.std(ddof=1) / np.sqrt(len(d))) if len(d) > 1 else 0.0
    return float(d.mean()), se


@dataclass(frozen=True)
class Judge:
    """The study's val split (the images every trial validates on, latentsweep.trainers.train.tasks.split_images of the
    study's
    [base]) and its leaderboard protocol: a candidate trained without these images is scored here by MRR."""
    train_images: np.ndarray  # [Nt] image indices the candidates may train on
    held_images: np.ndarray  # [Nv] image indices of the val split
    captions: np.ndarray  # [Nc, Dt] every caption of the train set, as loaded (not copied: the job holds the judge)
    caps: np.ndarray  # [Nq] the val captions, rows of `captions`
    gallery: np.ndarray  # [Nv, Di] the val images
    target: np.ndarray  # [Nq] each caption's image, as an index into `gallery`
    gallery_size: int
    seed: int

    @property
    def text(self) -> np.ndarray:
        """[Nq, Dt] the val captions (a copy, made for each use: 0.1 GB at challenge size)."""
        return np.asarray(take(self.captions, self.caps), np.float32)

    def per_image(self, rr: np.ndarray) -> np.ndarray:
        """[Nv] each val image's mean of its captions' reciprocal ranks `rr` [Nq]."""
        n = len(self.held_images)
        return np.bincount(self.target, rr, n) / np.maximum(np.bincount(self.target, minlength=n), 1)

    def score(self, pred: np.ndarray) -> Score:
        """Leaderboard MRR of the val captions' predictions `pred` [Nq, Di] (latentsweep.trainers.eval.metrics, as a
        trial's val/mrr: same images, same galleries), with each image's mean reciprocal rank."""
        ranks, mrr = leaderboard_ranks(pred, self.gallery, self.target, gallery_size=self.gallery_size,
                                       seed=self.seed)
        return Score(float(mrr), self.per_image(1.0 / ranks.astype(np.float64)))

    def score_models(self, models: Sequence[torch.nn.Module], weights: Sequence[float], device) -> Score:
        """MRR of the weighted ensemble of `models` (one model: weight 1) on the val captions."""
        kept = [(m, float(w)) for m, w in zip(models, weights) if w > 0]
        x = caption_rows(self.captions, self.caps, device)  # the val captions read in place, a block at a time
        # predicted gallery by gallery as they are ranked: no [Nq, Di] array held (0.15 GB at challenge size)
        kept_models, kept_weights = (list(column) for column in zip(*kept))
        return self.score(predicted_rows(kept_models, kept_weights, x, device, self.gallery.shape[1]))

    def score_floor(self, data: TrainSet, alpha: float) -> Score:
        """MRR of the closed-form ridge at strength `alpha` (the floor's) fit on the train part only: the floor as a
        candidate, like with like (one pass of moments over the train part's captions, one solve); the submission's
        floor is still the one fit on every image. The strength was chosen by the floor on a split of every image,
        val images included: one choice among latentsweep.trainers.models.closed_form.ALPHAS, not a fit."""
        ridge = solve(moments(data, captions_of(data.cap2img, self.train_images)), alpha)
        if self.gallery_size == GALLERY_SIZE:  # the same ranks, inside each gallery only (closed_form's)
            rr, mrr = held_out_rr(ridge, self.captions, self.gallery, self.target, seed=self.seed, caps=self.caps)
            return Score(mrr, self.per_image(rr))
        return self.score(ridge.predict(self.text))

    def describe(self) -> dict[str, Any]:
        return {"val_images": int(len(self.held_images)), "val_captions": int(len(self.caps)),
                "metric": "leaderboard MRR", "gallery_size": self.gallery_size, "eval_seed": self.seed}


def make_judge(base: Config, data: TrainSet) -> Judge | None:
    """The judge of a study whose [base] is `base`; None when it holds nothing out (data.split 'all') or its task is
    not caption -> image (no MRR to compare)."""
    if base.data.split == "all" or base.data.task != "translate":
        return None
    train_img, held_img = split_images(base, data)
    caps, local = captions_and_local_images(data.cap2img, held_img)
    return Judge(train_img, held_img, data.text, caps, np.asarray(take(data.image, held_img)), local, base.eval.gallery_size,
                 base.eval.seed)


@dataclass
class Standing:
    """The answer in place and its val score (None: not scored), and every answer offered so far."""
    source: str
    scored: Score | None
    offered: list[dict[str, Any]] = field(default_factory=list)
    judge: dict[str, Any] | None = None  # what the scores were measured on (Judge.describe)
    # Scores the answer in place and offers it, run once before the first other answer is offered: the floor is
    # scored only when something is compared with it (a short budget on a loaded machine often trains no trial).
    pending: Callable[[], None] | None = field(default=None, repr=False)

    @property
    def score(self) -> float | None:
        """The val MRR of the answer in place (None: not scored)."""
        return None if self.scored is None else self.scored.mrr

    def offer(self, source: str, score: Score | None, ties_win: bool = False) -> bool:
        """Whether the answer `source` scoring `score` replaces the one in place: only when its mean gain per val
        image is above Z_BETTER standard errors of that paired gain (or, with `ties_win`, when it ranks every val
        caption as the answer in place does: the pick's refits are the same configs trained on more images); an
        answer that cannot be compared (either score None) replaces it, as before any judge existed."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending()
        entry = {"answer": source, "val_mrr": None if score is None else score.mrr}
        if self.scored is None or score is None:
            wins = True
        else:
            mean, se = gain(score, self.scored)
            wins = mean > Z_BETTER * se or (ties_win and np.array_equal(score.per_image, self.scored.per_image))
            entry |= {"gain_per_image": mean, "gain_se": se}
        entry |= {"won": wins, "at_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        self.offered.append(entry)
        if wins:
            self.source, self.scored = source, score
        return wins

    def record(self) -> dict[str, Any]:
        """The manifest's `answer` field: the winner, its val MRR and its margin over the best answer it beat or
        that lost to it (None when it is the only one scored)."""
        others = [o["val_mrr"] for o in self.offered if o["answer"] != self.source and o["val_mrr"] is not None]
        margin = None if self.score is None or not others else self.score - max(others)
        return {"winner": self.source, "val_mrr": self.score, "margin_val_mrr": margin,
                "scored_on": self.judge, "offered": list(self.offered)}

    def lost_line(self, source: str, score: Score) -> str:
        """One line: `source` lost to the answer in place."""
        mean, se = gain(score, self.scored)
        return (f"{source} scores {score.mrr:.4f} MRR on the val split against {self.score:.4f} for the answer in "
                f"place ({self.source}): a gain of {mean:+.4f} per image, not above {Z_BETTER} standard errors "
                f"({se:.4f}, {len(score.per_image)} images): the submission stays {self.source}")


__all__ = ["Judge", "Score", "Standing", "Z_BETTER", "gain", "make_judge"]
