"""The pick's similarity boards (search/pick/boards.py) rank as the metrics module ranks the combined rows: singles,
running sums and weighted combinations, degenerate rows included, against oof.images_scorer as the oracle."""
from __future__ import annotations

import numpy as np
import pytest

from latentsweep.search.pick import ensemble, oof
from latentsweep.search.pick.boards import Board


def _members(n_images: int = 230, dim: int = 24, n: int = 3, seed: int = 0):
    rng = np.random.default_rng(seed)
    image = rng.standard_normal((n_images, dim)).astype(np.float32)
    cap2img = np.repeat(np.arange(n_images), 3)
    outs = [ensemble.l2n(image[cap2img] + 2.0 * rng.standard_normal((len(cap2img), dim)).astype(np.float32))
            for _ in range(n)]
    return image, cap2img, outs


def _expected(outs, picks, weights, score, caps):
    if weights is None:
        rows = np.sum([outs[i][caps] for i in picks], axis=0) if len(picks) > 1 else outs[picks[0]][caps]
        return score(rows if len(picks) == 1 else ensemble.l2n(rows))["mrr"]
    return score(ensemble.combine([o[caps] for o in outs], weights))["mrr"]


@pytest.mark.parametrize("which", ["all", "some"])
def test_a_board_scores_what_the_metrics_score_on_the_combined_rows(which):
    image, cap2img, outs = _members()
    images = np.arange(len(image)) if which == "all" else np.flatnonzero(np.arange(len(image)) % 3 != 1)
    caps, score = oof.images_scorer(images, image, cap2img, seed=2)
    board = Board(images, image, cap2img, seed=2)
    for out in outs:
        board.add(out)
    assert len(board) == 3 and np.array_equal(board.caps, caps)
    cases = [([0], None), ([2], None), ([1, 0], None), ([0, 2, 2], None), (range(3), [0.5, 0.0, 0.5]),
             (range(3), [0.2, 0.3, 0.5])]
    for picks, weights in cases:
        want = _expected(outs, list(picks), weights, score, caps)
        assert board.score(picks, weights) == pytest.approx(want, abs=1e-9), (list(picks), weights)


def test_degenerate_rows_and_images_get_the_worst_rank_as_the_metrics_give_it():
    image, cap2img, outs = _members(n_images=120)
    image[5] = 0.0  # an unusable image: never outranks, the worst rank for its captions
    image[7, 0] = np.nan
    outs[0][3] = np.nan  # a non-finite prediction: the worst rank wherever member 0 is used
    outs[1][4] = 0.0  # a zero prediction: the worst rank alone, ranked by the others in a sum
    outs[0][4] = 0.0
    outs[2][4] = 0.0  # every member zero there: the combined row is zero, the worst rank
    outs[1][10] = 0.0
    images = np.arange(len(image))
    caps, score = oof.images_scorer(images, image, cap2img)
    board = Board(images, image, cap2img)
    for out in outs:
        board.add(out)
    for picks, weights in [([0], None), ([1], None), ([1, 2], None), ([0, 1], None), (range(3), [0.0, 0.5, 0.5]),
                           (range(3), [1 / 3] * 3)]:
        want = _expected(outs, list(picks), weights, score, caps)
        assert board.score(picks, weights) == pytest.approx(want, abs=1e-9), (list(picks), weights)
    assert board.score([1]) < board.score([1, 2])  # the zero rows of member 1 are ranked by member 2 in the sum


def test_the_choices_on_a_board_are_the_choices_on_the_rows():
    image, cap2img, outs = _members(n_images=300, n=4, seed=3)
    images = np.arange(len(image))
    caps, score = oof.images_scorer(images, image, cap2img)
    board = Board(images, image, cap2img)
    for out in outs:
        board.add(out)
    for method in ensemble.METHODS:
        want = ensemble.method_weights(method, outs, lambda p: score(p)["mrr"], 6, normalised=True)
        np.testing.assert_array_equal(ensemble.weights_by(method, 4, board.score, 6), want)
