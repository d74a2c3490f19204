"""Out-of-fold ensemble selection: weights chosen on every labelled image, and a nested-fold figure of the gain.

Each candidate has one prediction per labelled caption made by a model that never saw that caption's image (k-fold
by image, as AutoGluon's bagging does). Greedy (Caruana) selection then runs on all images instead of half of a val
split. The honest figure comes from nesting the selection: for every fold g, weights and the best single member are
chosen on the other folds' images and both are scored on fold g, which that selection never saw. The spread of the
per-fold gains says whether a gain is real. Pure numpy on arrays; scores are the leaderboard MRR of
`latentsweep.trainers.eval.metrics`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np

from latentsweep.search.pick import boards, ensemble
from latentsweep.trainers.core.heap import release_free_heap
from latentsweep.trainers.data.splits import captions_and_local_images
from latentsweep.trainers.eval.metrics import GALLERY_SIZE, evaluate_leaderboard


@dataclass(frozen=True)
class Folds:
    """Image folds over the whole TrainSet: fold_of[i] is image i's fold (dealt by
    latentsweep.trainers.data.splits.fold_assignment)."""
    fold_of: np.ndarray  # int64 [Ni]
    cap2img: np.ndarray  # int64 [Nc]

    @property
    def n(self) -> int:
        return int(self.fold_of.max()) + 1

    def images(self, folds) -> np.ndarray:
        return np.flatnonzero(np.isin(self.fold_of, list(folds)))


def images_scorer(images: np.ndarray, image_emb: np.ndarray, cap2img: np.ndarray,
           seed: int = 0) -> tuple[np.ndarray, Callable[[np.ndarray], dict[str, float]]]:
    """(caption indices of `images`, fn(pred over those captions) -> leaderboard metrics against those images)."""
    caps, local = captions_and_local_images(cap2img, images)
    gallery = np.asarray(image_emb, np.float32)[images]
    size = min(GALLERY_SIZE, len(images))

    def score(pred: np.ndarray) -> dict[str, float]:
        return evaluate_leaderboard(pred, gallery, local, gallery_size=size, seed=seed)

    return caps, score


@dataclass
class OofSelection:
    """All figures are per-fold leaderboard MRRs averaged over the folds, so that they compare with a study's val MRR
    (a val split of similar size, scored alone) and with each other."""
    weights: np.ndarray  # [M] sum 1, chosen on all out-of-fold predictions
    best_single: int  # index of the best member by out-of-fold MRR
    member_mrr: np.ndarray  # [M] out-of-fold MRR of each member
    mean_mrr: float  # uniform average of all members
    ensemble_mrr: float  # the chosen ensemble, on the data it was chosen on (optimistic)
    fold_gains: np.ndarray  # [F] nested: ensemble - best single on fold g, both chosen on the other folds
    fold_ensemble: np.ndarray  # [F] nested ensemble MRR on fold g
    fold_best: np.ndarray  # [F] nested best-single MRR on fold g

    @property
    def gain(self) -> float:
        return float(self.fold_gains.mean())

    @property
    def gain_std(self) -> float:
        """Spread of the per-fold gains (sample std); the standard error is gain_std / sqrt(F)."""
        return float(self.fold_gains.std(ddof=1)) if len(self.fold_gains) > 1 else float("nan")

    @property
    def gain_se(self) -> float:
        """Standard error of the mean nested gain: its spread over the folds / sqrt(F)."""
        return self.gain_std / np.sqrt(len(self.fold_gains)) if len(self.fold_gains) > 1 else float("nan")

    @property
    def gain_is_real(self) -> bool:
        """The ensemble is submitted when its nested gain is above one standard error: the one-standard-error rule
        (Hastie, Tibshirani & Friedman, Elements of Statistical Learning, 2nd ed., sec. 7.10) applied to the choice
        between the simpler model (the best single member) and the ensemble. The nested gain is already an unbiased
        figure of the whole selection (weights chosen without the scored fold), so the rule only guards against a
        gain that is noise. The earlier rule, mean > std (a t statistic above sqrt(F)), rejected the ensemble in
        every demo holdout; docs/results.md has both rules measured on held-out captions."""
        spread = self.gain_se if np.isfinite(self.gain_se) else 0.0
        return self.gain > spread


def nested_select(oof: Iterable[np.ndarray], folds: Folds, image_emb: np.ndarray, method: str, size: int,
                  seed: int = 0, in_place: bool = False) -> OofSelection:
    """Weights on all images, plus the nested per-fold gains. oof: each member's predictions [Nc, Di] for every
    caption of the TrainSet, each made by the fold model that did not train on the caption's image.

    The members are read one at a time (a generator may make each as it is read): each is L2-normalised (in place
    with `in_place`, which the caller's array then holds, else in a copy) and ranked once against the galleries of
    every image set a figure is taken on (`boards.Board`: all images, each fold's, the other folds' of each), then
    let go. Every choice and score reads those similarities: 6 x 100 floats a caption and member with 5 folds,
    against 1,536 for a member's rows at challenge size (0.15 GB each for 25,000 val captions)."""
    ensemble.check_method(method)
    everything = boards.Board(np.arange(len(folds.fold_of)), image_emb, folds.cap2img, seed)
    inner = [boards.Board(folds.images(set(range(folds.n)) - {g}), image_emb, folds.cap2img, seed)
             for g in range(folds.n)]
    outer = [boards.Board(folds.images({g}), image_emb, folds.cap2img, seed) for g in range(folds.n)]
    for out in oof:
        member = ensemble.l2n_(out if in_place else np.array(out, np.float32))
        for board in (everything, *inner, *outer):
            board.add(member)
        del member, out
        release_free_heap()  # the member's gallery blocks, under the next member's
    n = len(everything)
    # [F, M]: each member's MRR on the other folds (for the nested best single) and on fold g
    given_in = [[board.score([i]) for i in range(n)] for board in inner]
    given_out = [[board.score([i]) for i in range(n)] for board in outer]
    weights = ensemble.weights_by(method, n, everything.score, size)
    uniform = np.full(n, 1.0 / n)
    per_fold = {"mean": [], "ensemble": [], "nested_ensemble": [], "nested_best": []}
    for g in range(folds.n):
        w_g = ensemble.weights_by(method, n, inner[g].score, size)
        for key, w in (("mean", uniform), ("ensemble", weights), ("nested_ensemble", w_g)):
            per_fold[key].append(outer[g].score(range(n), w))
        per_fold["nested_best"].append(given_out[g][int(np.argmax(given_in[g]))])
    ens, single = np.array(per_fold["nested_ensemble"]), np.array(per_fold["nested_best"])
    member_mrr = np.mean(given_out, axis=0)
    return OofSelection(weights, int(np.argmax(member_mrr)), member_mrr, float(np.mean(per_fold["mean"])),
                        float(np.mean(per_fold["ensemble"])), ens - single, ens, single)


__all__ = ["Folds", "OofSelection", "images_scorer", "nested_select"]
