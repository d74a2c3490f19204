"""Costs that grow with the data (issue 38), on small data: the closed form's gallery-only scoring against the metrics
module's, the train file read once per machine (the memory-mapped cache), the knn checkpoint without its keys, and
the knn side trial's estimate before it starts."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from trainers.closed_form import ALPHAS, fit_ridge, held_out_mrr, moments, solve
from trainers.data import load_train
from trainers.metrics import evaluate_leaderboard
from trainers.synthetic import write_synthetic


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    train, _, _ = write_synthetic(tmp_path_factory.mktemp("real-size") / "d", 260, dim_text=12, dim_image=20,
                                  n_test=20)
    return train


def test_the_ridge_scores_its_galleries_as_the_leaderboard_does(small):
    data = load_train(small)
    ridge = solve(moments(data, np.arange(150 * 5)), 0.1)
    held = np.arange(len(data.cap2img))[data.cap2img >= 50]  # captions of images 50.. (a gallery of 100 and a top-up)
    image = data.image[50:].copy()
    image[3] = 0.0  # a degenerate image: never outranks, the worst rank as a target
    local = data.cap2img[held] - 50
    for seed in (0, 1):
        want = evaluate_leaderboard(ridge.predict(data.text[held]), image, local, seed=seed)["mrr"]
        assert held_out_mrr(ridge, data.text[held], image, local, seed) == pytest.approx(want, abs=1e-6)


def test_the_chosen_strength_has_the_best_held_out_score(small):
    ridge, scores = fit_ridge(load_train(small))
    assert set(scores) == set(ALPHAS) and ridge.alpha == max(scores, key=scores.get)
    assert len(set(scores.values())) > 1  # the strengths are told apart, not all scored alike
