"""Ensemble math for `latentsweep pick`: select/report halves of the val images, combining members, selection methods.

Pure numpy/torch on arrays; no Optuna, MLflow or files. Members are combined as the weighted mean of their
L2-normalised outputs, L2-normalised again (`combine`); every score is the leaderboard MRR of
`latentsweep.trainers.eval.metrics`.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from latentsweep.trainers.data.splits import captions_and_local_images
from latentsweep.trainers.core.errors import LatentsweepError
from latentsweep.trainers.eval.metrics import GALLERY_SIZE, evaluate_leaderboard
from latentsweep.trainers.train.tasks import predict

# Salt of the select/report split of the val images: must differ from any data.salt so that the halves do not
# line up with the train/val split (which hashes salt + name with the study's data.salt, "" by default).
HALF_SALT = "latentsweep.pick.halves/"
METHODS = ("greedy", "mean", "weighted")
# Norm floor when normalising: a zero row stays zero instead of becoming NaN (metrics rank such a query last).
_EPS = 1e-12


def predict_all(models: list[torch.nn.Module], x: np.ndarray, device) -> list[np.ndarray]:
    """Each model's predictions [N, Di] (numpy float32) for caption embeddings x [N, Dt]."""
    xt = torch.as_tensor(np.ascontiguousarray(x, np.float32), device=device)
    return [predict(m, xt).cpu().numpy() for m in models]


@dataclass(frozen=True)
class Half:
    """One half of the val images with their captions (indices into the TrainSet)."""
    name: str
    images: np.ndarray  # int64 [Ni_h] image indices
    captions: np.ndarray  # int64 [Nc_h] caption indices (every caption of these images)
    cap2local: np.ndarray  # int64 [Nc_h] position of each caption's image in `images`

    @property
    def gallery_size(self) -> int:
        """Galleries of 100 distinct images, or the whole half when it has fewer images."""
        return min(GALLERY_SIZE, len(self.images))


def _half(name: str, images: np.ndarray, cap2img: np.ndarray) -> Half:
    images = np.sort(np.asarray(images, np.int64))
    return Half(name, images, *captions_and_local_images(cap2img, images))


def split_halves(val_images: np.ndarray, image_names: np.ndarray, cap2img: np.ndarray,
                 salt: str = HALF_SALT) -> tuple[Half, Half]:
    """(select, report): the val IMAGES ordered by MD5(salt + name), first half (rounded up) to select, rest to report.

    Splitting images, not captions, keeps every caption of an image on one side, so no image is seen by both.
    """
    val_images = np.asarray(val_images, np.int64)
    if len(val_images) < 2:
        raise LatentsweepError(f"the val split has {len(val_images)} image(s): at least 2 are needed to split it "
                               "into select and report halves")
    keys = [hashlib.md5(f"{salt}{image_names[i]}".encode()).hexdigest() for i in val_images]
    order = val_images[np.argsort(keys, kind="stable")]
    cut = (len(order) + 1) // 2
    return _half("select", order[:cut], cap2img), _half("report", order[cut:], cap2img)


def l2n(x: np.ndarray) -> np.ndarray:
    """Row-wise L2 normalisation of [N, D] as float32."""
    x = np.asarray(x, np.float32)
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), _EPS)


def combine(outputs: list[np.ndarray], weights) -> np.ndarray:
    """Weighted mean of the members' L2-normalised outputs [N, D], then L2-normalised: float32 [N, D]."""
    weights = np.asarray(weights, np.float64)
    if len(outputs) != len(weights) or not len(outputs):
        raise ValueError(f"combine: {len(outputs)} outputs but {len(weights)} weights")
    total = np.zeros_like(np.asarray(outputs[0], np.float32))
    for out, w in zip(outputs, weights):
        if w:
            total += np.float32(w) * l2n(out)
    return l2n(total)


def half_scorer(half: Half, image: np.ndarray, seed: int = 0) -> Callable[[np.ndarray], dict[str, float]]:
    """fn(pred [Nc_h, Di]) -> leaderboard metrics of the half (its captions against its images)."""
    gallery = np.asarray(image, np.float32)[half.images]

    def score(pred: np.ndarray) -> dict[str, float]:
        return evaluate_leaderboard(pred, gallery, half.cap2local, gallery_size=half.gallery_size, seed=seed)

    return score


def greedy_counts(outputs: list[np.ndarray], mrr_of: Callable[[np.ndarray], float], size: int) -> np.ndarray:
    """Caruana et al. (2004) forward selection with replacement; returns how often each member was picked (int [M]).

    Starts from the best single member, then at each step adds the member whose addition gives the highest MRR of
    the combined output, up to `size` picks; stops early when no addition improves the MRR strictly.
    outputs: each member's L2-normalised predictions [Q, D] on the select half (the library, already pruned).
    """
    if size < 1:
        raise LatentsweepError(f"--size must be >= 1, got {size}")
    singles = [mrr_of(out) for out in outputs]
    best = int(np.argmax(singles))
    counts = np.zeros(len(outputs), np.int64)
    counts[best] = 1
    running = np.array(outputs[best], np.float32)  # [Q, D] sum of picked normalised outputs (count-weighted)
    current = singles[best]
    for _ in range(size - 1):
        trials = [mrr_of(l2n(running + out)) for out in outputs]
        pick = int(np.argmax(trials))
        if trials[pick] <= current:
            break
        counts[pick] += 1
        running += outputs[pick]
        current = trials[pick]
    return counts


def method_weights(method: str, outputs: list[np.ndarray], mrr_of: Callable[[np.ndarray], float],
                   size: int) -> np.ndarray:
    """Member weights [M] (sum 1) chosen on `outputs` only (out-of-fold predictions, or the select half's).

    greedy: pick counts of `greedy_counts` / their sum. mean: uniform. weighted: proportional to each member's
    MRR on those outputs (not a softmax: members of one study score within a few points of each other, so
    proportional weights stay close to uniform, and a softmax would need a temperature that is one more knob fitted
    on the same outputs).
    """
    if method not in METHODS:
        raise LatentsweepError(f"--method must be one of {', '.join(METHODS)}, got '{method}'")
    if len(outputs) == 1 and size >= 1:  # weight 1 by every method: no normalised copy, no greedy step to score
        return np.ones(1)
    normed = [l2n(out) for out in outputs]
    if method == "greedy":
        raw = greedy_counts(normed, mrr_of, size).astype(np.float64)
    elif method == "mean":
        raw = np.ones(len(outputs))
    else:
        raw = np.array([max(mrr_of(out), 0.0) for out in normed])
        if raw.sum() <= 0:
            raw = np.ones(len(outputs))
    return raw / raw.sum()


__all__ = ["Half", "split_halves", "l2n", "combine", "half_scorer", "predict_all", "greedy_counts", "method_weights",
           "METHODS", "HALF_SALT"]
