"""The closed-form answer (latentsweep.trainers.models.closed_form) against a naive float64 ridge, and the one-budget
job's floor."""
from __future__ import annotations

import numpy as np
import pytest

from latentsweep.trainers.models.closed_form import ALPHAS, fit_ridge, moments, solve
from latentsweep.trainers.data.sets import load_train
from latentsweep.trainers.data.synthetic import write_synthetic


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    train, _, _ = write_synthetic(tmp_path_factory.mktemp("ridge") / "d", 120, dim_text=12, dim_image=20, n_test=20)
    return load_train(train)


def naive_ridge(x: np.ndarray, y: np.ndarray, alpha: float) -> np.ndarray:
    """(x - mx) W + my with W = (Cxx + alpha tr(Cxx)/D I)^-1 Cxy, every step in float64 on whole arrays."""
    x, y = x.astype(np.float64), y.astype(np.float64)
    mx, my = x.mean(0), y.mean(0)
    cxx = (x - mx).T @ (x - mx) / len(x)
    cxy = (x - mx).T @ (y - my) / len(x)
    w = np.linalg.solve(cxx + alpha * np.trace(cxx) / len(cxx) * np.eye(len(cxx)), cxy)
    return lambda q: (q - mx) @ w + my


@pytest.mark.parametrize("block", [1, 7, 10_000])
def test_blocked_moments_give_the_naive_ridge(data, block):
    caps = np.arange(len(data.cap2img))
    y = data.image[data.cap2img]
    for alpha in ALPHAS:
        mine = solve(moments(data, caps, block=block), alpha).predict(data.text[:30])
        np.testing.assert_allclose(mine, naive_ridge(data.text, y, alpha)(data.text[:30]), rtol=1e-4, atol=1e-5)


def test_the_strength_is_chosen_on_held_out_images_and_refitted_on_all(data):
    ridge, scores = fit_ridge(data)
    assert set(scores) == set(ALPHAS) and ridge.alpha == max(scores, key=scores.get)
    y = data.image[data.cap2img]
    np.testing.assert_allclose(ridge.predict(data.text[:10]), naive_ridge(data.text, y, ridge.alpha)(data.text[:10]),
                               rtol=1e-4, atol=1e-5)
