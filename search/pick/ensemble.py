"""Ensemble math for `latentsweep pick`: select/report halves of the val images, combining members, selection methods.

Pure numpy/torch on arrays; no Optuna, MLflow or files. Members are combined as the weighted mean of their
L2-normalised outputs, L2-normalised again (`combine`); every score is the leaderboard MRR of
`latentsweep.trainers.eval.metrics`.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np
import torch

from latentsweep.trainers.core.pages import take
from latentsweep.trainers.core.heap import release_free_heap
from latentsweep.trainers.data.rows import Rows
from latentsweep.trainers.data.splits import captions_and_local_images
from latentsweep.trainers.core.errors import LatentsweepError
from latentsweep.trainers.eval.metrics import GALLERY_SIZE, RowQueries, evaluate_leaderboard
from latentsweep.trainers.train.tasks import predict

# Salt of the select/report split of the val images: must differ from any data.salt so that the halves do not
# line up with the train/val split (which hashes salt + name with the study's data.salt, "" by default).
HALF_SALT = "latentsweep.pick.halves/"
METHODS = ("greedy", "mean", "weighted")
# Norm floor when normalising: a zero row stays zero instead of becoming NaN (metrics rank such a query last).
_EPS = 1e-12
# Rows per step of the row-wise work done in place (norms, gathered sums): a [1024, 1536] float32 step is 6 MB, where
# numpy's whole-array expressions make [N, D] temporaries (0.15 GB each for 25,000 val captions at challenge size).
ROW_STEP = 1024


def predict_all(models: list[torch.nn.Module], x: np.ndarray | Rows, device) -> list[np.ndarray]:
    """Each model's predictions [N, Di] (numpy float32) for caption embeddings x [N, Dt] (an array, or Rows of the
    loaded captions, gathered a block at a time: `caption_rows`)."""
    return list(predict_each(models, x, device))


def predict_each(models: list[torch.nn.Module], x: np.ndarray | Rows, device) -> Iterator[np.ndarray]:
    """`predict_all`'s arrays made one at a time, as they are read (a reader that lets each go holds one)."""
    xt = x if isinstance(x, Rows) else torch.as_tensor(np.ascontiguousarray(x, np.float32), device=device)
    for model in models:
        out = predict(model, xt).cpu().numpy()
        release_free_heap()  # its blocks' freed chunks (25 MB each at challenge size), kept resident by glibc
        yield out
        del out  # before the next model's: this frame would hold it until then


def caption_rows(text: np.ndarray, caps: np.ndarray, device) -> np.ndarray | Rows:
    """The captions `caps` [Nq] of the loaded captions `text` [Nc, Dt], for predict_all: on the CPU as Rows read in
    place (a copy of a study's val captions is 0.1 GB at challenge size); a float32 copy elsewhere."""
    if torch.device(device).type != "cpu" or text.dtype != np.float32:
        return np.asarray(take(text, caps), np.float32)
    return Rows(torch.as_tensor(text), torch.as_tensor(np.asarray(caps, np.int64)))


def predict_combined(models: list[torch.nn.Module], weights, x: np.ndarray | Rows, device) -> np.ndarray:
    """combine(predict_all(models, x, device), weights) with one member's predictions held at a time: float32
    [N, Di], the same values (each member normalised, weighted and summed in the same order, in place)."""
    weights = np.asarray(weights, np.float64)
    if len(models) != len(weights) or not np.any(weights):
        raise ValueError(f"predict_combined: {len(models)} models, weights {weights.tolist()}")
    total = None
    for model, w in zip(models, weights):
        if w:
            out = predict_all([model], x, device)[0]
            total = np.zeros_like(out) if total is None else total
            np.multiply(l2n_(out), np.float32(w), out=out)
            total += out
            del out
    return l2n_(total)


def predicted_rows(models: list[torch.nn.Module], weights, x: np.ndarray | Rows, device, dim: int) -> RowQueries:
    """The predictions [N, dim] of x's rows by `models` (one: its own; several: `predict_combined`'s), made for the
    rows a gallery ranks (metrics.RowQueries): a judge's score holds one gallery's block of them, not every row
    (0.15 GB at challenge size, twice for an ensemble, beside a trial training in the same process)."""
    def take(rows: np.ndarray) -> np.ndarray:
        part = x[torch.from_numpy(rows)] if isinstance(x, Rows) else np.asarray(x)[rows]
        if len(models) == 1:
            return predict_all(models, part, device)[0]
        return predict_combined(models, weights, part, device)

    return RowQueries(len(x), dim, take)


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


def l2n_(x: np.ndarray) -> np.ndarray:
    """`l2n` in place on a float32 [N, D] array, its norms taken ROW_STEP rows at a time (a row's norm is its own
    row's sum, so the same values): no [N, D] temporary. Returns x."""
    for start in range(0, len(x), ROW_STEP):
        rows = x[start:start + ROW_STEP]
        np.divide(rows, np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), _EPS), out=rows)
    return x


def combine(outputs: list[np.ndarray], weights) -> np.ndarray:
    """Weighted mean of the members' L2-normalised outputs [N, D], then L2-normalised: float32 [N, D] (`member_rows`
    makes the same rows of already normalised outputs without the [N, D] sum)."""
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


def member_rows(outputs: list[np.ndarray], picks, rows: np.ndarray | None = None, weights=None,
                normalise: bool = True) -> RowQueries:
    """The combined rows of `outputs[picks]` as a RowQueries over `rows` (all rows when None): a gallery's rows are
    made when it is ranked, so no [len(rows), D] sum is held. Without `weights` the picks' rows are summed in their
    order ((p1 + p2) + ...: a running sum's order); with them, zeros plus weight * rows for each non-zero weight (in
    `combine`'s order); `normalise`: each summed row L2-normalised (`l2n_`). One pick unnormalised is that member's
    rows as they are. The same float32 operations row by row as summing whole arrays, so the same values."""
    picks = list(picks)

    def take(positions: np.ndarray) -> np.ndarray:
        at = positions if rows is None else rows[positions]
        if weights is None:
            total = np.take(outputs[picks[0]], at, axis=0)
            for i in picks[1:]:
                total += np.take(outputs[i], at, axis=0)
        else:
            total = np.zeros((len(at), outputs[0].shape[1]), np.float32)
            for i, w in zip(picks, weights):
                if w:
                    total += np.float32(w) * np.take(outputs[i], at, axis=0)
        return l2n_(total) if normalise else total

    n = len(outputs[0]) if rows is None else len(rows)
    return RowQueries(n, outputs[0].shape[1], take)


# A selection's score: the MRR of the members `picks` combined, summed in their order (weights None: a running sum, one
# pick as it is) or weighted (zeros plus weight x member for each non-zero weight, `combine`'s order), ranked as the
# leaderboard ranks. Made from member rows (`rows_score`) or from their gallery similarities (latentsweep.search.pick
# .boards.Board.score: the same ranks to float rounding, S floats a caption instead of D).
Score = Callable[[Sequence[int], Sequence[float] | None], float]


def rows_score(outputs: list[np.ndarray], mrr_of: Callable[[RowQueries], float],
               rows: np.ndarray | None = None) -> Score:
    """The Score of L2-normalised `outputs` at their rows `rows` (all when None), each combination made gallery by
    gallery as `mrr_of` ranks it (`member_rows`, normalised unless it is one pick as it is)."""
    def score(picks: Sequence[int], weights: Sequence[float] | None = None) -> float:
        picks = list(picks)
        return mrr_of(member_rows(outputs, picks, rows, weights, normalise=weights is not None or len(picks) > 1))

    return score


def greedy_counts(outputs: list[np.ndarray], mrr_of: Callable[[RowQueries], float], size: int,
                  rows: np.ndarray | None = None) -> np.ndarray:
    """`counts_by` on L2-normalised `outputs` [Q, D] at their rows `rows` (all when None): each trial's sum is made
    gallery by gallery as it is scored (`member_rows`), so the choice holds no [len(rows), D] array."""
    return counts_by(len(outputs), rows_score(outputs, mrr_of, rows), size)


def counts_by(n: int, score: Score, size: int) -> np.ndarray:
    """Caruana et al. (2004) forward selection with replacement over `n` members; returns how often each member was
    picked (int [n]).

    Starts from the best single member, then at each step adds the member whose addition gives the highest MRR of
    the combined output, up to `size` picks; stops early when no addition improves the MRR strictly.
    """
    if size < 1:
        raise LatentsweepError(f"--size must be >= 1, got {size}")
    singles = [score([i], None) for i in range(n)]
    best = int(np.argmax(singles))
    counts = np.zeros(n, np.int64)
    counts[best] = 1
    picks, current = [best], singles[best]
    for _ in range(size - 1):
        trials = [score([*picks, member], None) for member in range(n)]
        pick = int(np.argmax(trials))
        if trials[pick] <= current:
            break
        counts[pick] += 1
        picks.append(pick)
        current = trials[pick]
    return counts


def method_weights(method: str, outputs: list[np.ndarray], mrr_of: Callable[[RowQueries], float],
                   size: int, rows: np.ndarray | None = None, normalised: bool = False) -> np.ndarray:
    """`weights_by` on `outputs` (out-of-fold predictions, or the select half's) at their rows `rows` (all when
    None); `normalised`: the outputs are L2-normalised already (`l2n_`), else normalised copies are made here.
    `mrr_of` scores a RowQueries (`member_rows`; `np.asarray` makes its array)."""
    check_method(method)
    if len(outputs) == 1 and size >= 1:  # weight 1 by every method: no normalised copy, no greedy step to score
        return np.ones(1)
    normed = outputs if normalised else [l2n(out) for out in outputs]
    return weights_by(method, len(normed), rows_score(normed, mrr_of, rows), size)


def check_method(method: str) -> None:
    if method not in METHODS:
        raise LatentsweepError(f"--method must be one of {', '.join(METHODS)}, got '{method}'")


def weights_by(method: str, n: int, score: Score, size: int) -> np.ndarray:
    """Member weights [n] (sum 1) chosen by `score` alone.

    greedy: pick counts of `counts_by` / their sum. mean: uniform. weighted: proportional to each member's MRR (not
    a softmax: members of one study score within a few points of each other, so proportional weights stay close to
    uniform, and a softmax would need a temperature that is one more knob fitted on the same outputs).
    """
    check_method(method)
    if n == 1 and size >= 1:  # weight 1 by every method: no greedy step to score
        return np.ones(1)
    if method == "greedy":
        raw = counts_by(n, score, size).astype(np.float64)
    elif method == "mean":
        raw = np.ones(n)
    else:
        raw = np.array([max(score([i], None), 0.0) for i in range(n)])
        if raw.sum() <= 0:
            raw = np.ones(n)
    return raw / raw.sum()


__all__ = ["Half", "split_halves", "l2n", "l2n_", "combine", "half_scorer", "predict_all", "predict_combined",
           "predicted_rows", "caption_rows", "greedy_counts", "member_rows", "method_weights", "METHODS", "HALF_SALT",
           "Score", "counts_by", "rows_score", "weights_by", "check_method", "predict_each"]
