"""The held-out images every candidate answer of a `latentsweep run` job is scored on (the closed-form floor, each
trial's checkpoint, the pick's ensemble), so an answer is replaced only by a better one on the same images, and the
standings the manifest records (which answer won, by how much)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from latentsweep.search.pick.ensemble import combine, predict_all
from latentsweep.trainers.models.closed_form import held_out_mrr, moments, solve
from latentsweep.trainers.config.tree import Config
from latentsweep.trainers.data.sets import TrainSet
from latentsweep.trainers.eval.metrics import GALLERY_SIZE, evaluate_leaderboard
from latentsweep.trainers.data.splits import captions_and_local_images, captions_of
from latentsweep.trainers.train.tasks import split_images


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
        return np.asarray(self.captions[self.caps], np.float32)

    def score(self, pred: np.ndarray) -> float:
        """Leaderboard MRR of the val captions' predictions `pred` [Nq, Di] (latentsweep.trainers.eval.metrics, as a
        trial's
        val/mrr: same images, same galleries)."""
        return float(evaluate_leaderboard(pred, self.gallery, self.target, gallery_size=self.gallery_size,
                                          seed=self.seed)["mrr"])

    def score_models(self, models: Sequence[torch.nn.Module], weights: Sequence[float], device) -> float:
        """MRR of the weighted ensemble of `models` (one model: weight 1) on the val captions."""
        kept = [(m, float(w)) for m, w in zip(models, weights) if w > 0]
        preds = predict_all([m for m, _ in kept], self.text, device)
        return self.score(combine(preds, [w for _, w in kept]) if len(preds) > 1 else preds[0])

    def score_floor(self, data: TrainSet, alpha: float) -> float:
        """MRR of the closed-form ridge at strength `alpha` (the floor's) fit on the train part only: the floor as a
        candidate, like with like (one pass of moments over the train part's captions, one solve); the submission's
        floor is still the one fit on every image. The strength was chosen by the floor on a split of every image,
        val images included: one choice among latentsweep.trainers.models.closed_form.ALPHAS, not a fit."""
        ridge = solve(moments(data, captions_of(data.cap2img, self.train_images)), alpha)
        if self.gallery_size == GALLERY_SIZE:  # the same MRR, ranked inside each gallery only (closed_form's)
            return float(held_out_mrr(ridge, self.captions, self.gallery, self.target, seed=self.seed, caps=self.caps))
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
    return Judge(train_img, held_img, data.text, caps, np.asarray(data.image[held_img]), local, base.eval.gallery_size,
                 base.eval.seed)


@dataclass
class Standing:
    """The answer in place and its val MRR (None: not scored), and every answer offered so far."""
    source: str
    score: float | None
    offered: list[dict[str, Any]] = field(default_factory=list)
    judge: dict[str, Any] | None = None  # what the scores were measured on (Judge.describe)
    # Scores the answer in place and offers it, run once before the first other answer is offered: the floor is
    # scored only when something is compared with it (a short budget on a loaded machine often trains no trial).
    pending: Callable[[], None] | None = field(default=None, repr=False)

    def offer(self, source: str, score: float | None, ties_win: bool = False) -> bool:
        """Whether the answer `source` scoring `score` replaces the one in place: only when strictly better (or
        equal, with `ties_win`: the pick's refits are the same configs trained on more images); an answer that
        cannot be compared (either score None) replaces it, as before any judge existed."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending()
        wins = (self.score is None or score is None or score > self.score
                or (ties_win and score == self.score))
        self.offered.append({"answer": source, "val_mrr": score, "won": wins,
                             "at_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
        if wins:
            self.source, self.score = source, score
        return wins

    def record(self) -> dict[str, Any]:
        """The manifest's `answer` field: the winner, its val MRR and its margin over the best answer it beat or
        that lost to it (None when it is the only one scored)."""
        others = [o["val_mrr"] for o in self.offered if o["answer"] != self.source and o["val_mrr"] is not None]
        margin = None if self.score is None or not others else self.score - max(others)
        return {"winner": self.source, "val_mrr": self.score, "margin_val_mrr": margin,
                "scored_on": self.judge, "offered": list(self.offered)}

    def lost_line(self, source: str, score: float | None) -> str:
        """One line: `source` lost to the answer in place."""
        return (f"{source} scores {score:.4f} MRR on the val split, not above the answer in place ({self.source}, "
                f"{self.score:.4f}): the submission stays {self.source}")


__all__ = ["Judge", "Standing", "make_judge"]
