"""The one ridge solver (trainers/models/ridge.py) against the textbook ridge, and its callers against it."""
from __future__ import annotations

import numpy as np
import torch

from latentsweep.trainers.models.geometry import ridge_fit
from latentsweep.trainers.models.ridge import ALPHAS, Moments, ridge_weights, solve


def _data(n=200, dx=6, dy=4, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, dx)) + 3.0  # off-centre, so a solver that forgets the centring is caught
    y = x @ rng.normal(size=(dx, dy)) + 0.1 * rng.normal(size=(n, dy)) - 1.0
    return x, y


def _textbook(x, y, lam):
    """argmin_W ||Xc W - Yc||^2 + lam ||W||^2 (sum-of-squares convention)."""
    xc, yc = x - x.mean(0), y - y.mean(0)
    return np.linalg.solve(xc.T @ xc + lam * np.eye(x.shape[1]), xc.T @ yc)


def test_ridge_weights_is_the_textbook_ridge():
    x, y = _data()
    xc, yc = x - x.mean(0), y - y.mean(0)
    cxx, cxy = torch.from_numpy(xc.T @ xc / len(x)), torch.from_numpy(xc.T @ yc / len(x))
    for lam in (0.0, 5.0, 500.0):
        np.testing.assert_allclose(ridge_weights(cxx, cxy, lam / len(x)).numpy(), _textbook(x, y, lam), atol=1e-9)


def test_solve_uses_a_strength_relative_to_the_mean_eigenvalue():
    x, y = _data()
    m = Moments(len(x), *(torch.from_numpy(a) for a in (x.sum(0), y.sum(0), x.T @ x, x.T @ y)))
    xc = x - x.mean(0)
    mean_eig = np.trace(xc.T @ xc / len(x)) / x.shape[1]
    for alpha in ALPHAS:
        ridge = solve(m, alpha)
        np.testing.assert_allclose(ridge.W.numpy(), _textbook(x, y, alpha * mean_eig * len(x)), atol=1e-8)
        np.testing.assert_allclose(ridge.predict(x[:3]), (x[:3] - x.mean(0)) @ ridge.W.numpy() + y.mean(0),
                                   atol=1e-5)


def test_geometry_ridge_is_least_squares_at_zero_strength_and_shrinks_above():
    x, y = _data()
    w, b = ridge_fit(torch.from_numpy(x), torch.from_numpy(y), lam=50.0, whiten_eps=0.0)
    # ZCA whitening then ridge is not plain ridge at lam > 0 (the penalty acts on whitened weights); at 0 both are OLS
    w0, _ = ridge_fit(torch.from_numpy(x), torch.from_numpy(y), lam=0.0, whiten_eps=0.0)
    np.testing.assert_allclose(w0.numpy(), _textbook(x, y, 0.0), atol=1e-8)
    assert not np.allclose(w.numpy(), w0.numpy())  # the strength reaches the solver
    np.testing.assert_allclose(b.numpy(), y.mean(0) - x.mean(0) @ w.numpy(), atol=1e-8)
