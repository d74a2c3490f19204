"""Closed-form text->image linear maps (whitened ridge, whitened orthogonal Procrustes), computed in float64.

Both solvers return `(W, b)` with W [dim_in, dim_out] and b [dim_out] such that `Y ≈ X @ W + b`
(so an `nn.Linear(dim_in, dim_out)` takes `weight = W.T`, `bias = b`). They run on the inputs' device and
return tensors of X's dtype there. Covariances are accumulated in row chunks so that a 125k x 1024 float32 input
never needs a full float64 copy.
"""
from __future__ import annotations

import torch

from latentsweep.trainers.models.ridge import ridge_weights

# Rows per chunk when accumulating moments: 8192 x 1536 float64 is ~100 MB, small on any device.
_CHUNK = 8192


def _work_device(t: torch.Tensor) -> torch.device:
    """The device to do float64 algebra on: the tensor's own, except MPS (no float64 support) -> CPU."""
    return torch.device("cpu") if t.device.type == "mps" else t.device


def _moments(X: torch.Tensor, Y: torch.Tensor, with_cyy: bool):
    """Means and (1/N) covariances in float64: mx [Dx], my [Dy], Cxx [Dx, Dx], Cxy [Dx, Dy], Cyy [Dy, Dy] or None.

    Cyy is optional because it is the costliest product (Dy = 1536 > Dx = 1024) and ridge does not need it.
    """
    dev = _work_device(X)
    n = X.shape[0]
    mx = torch.zeros(X.shape[1], dtype=torch.float64, device=dev)
    my = torch.zeros(Y.shape[1], dtype=torch.float64, device=dev)
    for i in range(0, n, _CHUNK):
        mx += X[i:i + _CHUNK].to(dev, torch.float64).sum(0)
        my += Y[i:i + _CHUNK].to(dev, torch.float64).sum(0)
    mx, my = mx / n, my / n
    cxx = torch.zeros(X.shape[1], X.shape[1], dtype=torch.float64, device=dev)
    cxy = torch.zeros(X.shape[1], Y.shape[1], dtype=torch.float64, device=dev)
    cyy = torch.zeros(Y.shape[1], Y.shape[1], dtype=torch.float64, device=dev) if with_cyy else None
    for i in range(0, n, _CHUNK):  # second pass on centred rows: stabler than E[xx^T] - mm^T
        xc = X[i:i + _CHUNK].to(dev, torch.float64) - mx
        yc = Y[i:i + _CHUNK].to(dev, torch.float64) - my
        cxx += xc.T @ xc
        cxy += xc.T @ yc
        if with_cyy:
            cyy += yc.T @ yc
    return mx, my, cxx / n, cxy / n, (cyy / n if with_cyy else None)


def _sqrt_pair(cov: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """ZCA whitening and colouring matrices: (C + eps I)^(-1/2) and (C + eps I)^(1/2), both symmetric [D, D]."""
    evals, evecs = torch.linalg.eigh(cov)
    evals = evals.clamp_min(0.0) + eps  # tiny negative eigenvalues are round-off of a PSD matrix
    white = (evecs * evals.rsqrt()) @ evecs.T
    colour = (evecs * evals.sqrt()) @ evecs.T
    return white, colour


def _check_fit_inputs(X: torch.Tensor, Y: torch.Tensor, whiten_eps: float) -> None:
    if X.ndim != 2 or Y.ndim != 2 or X.shape[0] != Y.shape[0] or X.shape[0] < 2:
        raise ValueError(f"need X [N, Dx] and Y [N, Dy] with N >= 2, got {tuple(X.shape)} and {tuple(Y.shape)}")
    if whiten_eps < 0:
        raise ValueError(f"whiten_eps must be >= 0, got {whiten_eps}")


def _map_and_intercept(W: torch.Tensor, mx: torch.Tensor, my: torch.Tensor, like: torch.Tensor):
    """(W, b = my - mx W) on `like`'s device and dtype: the affine map x W + b fitted on centred data."""
    b = my - mx @ W
    return W.to(like.device, like.dtype), b.to(like.device, like.dtype)


def ridge_fit(X: torch.Tensor, Y: torch.Tensor, lam: float, whiten_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Ridge regression on ZCA-whitened, centred inputs: min_M ||Z M - Yc||^2 + lam ||M||^2 with Z = Xc Wh.

    `lam` uses the sum-of-squares convention (as sklearn's Ridge), so its effect shrinks as N grows; lam -> 0 is
    ordinary least squares. Returns W = Wh M [Dx, Dy] and b = mean(Y) - mean(X) W [Dy].
    """
    _check_fit_inputs(X, Y, whiten_eps)
    n = X.shape[0]
    mx, my, cxx, cxy, _ = _moments(X, Y, with_cyy=False)
    white, _ = _sqrt_pair(cxx, whiten_eps)
    # Normal equations divided by N: (Wh Cxx Wh + lam/N I) M = Wh Cxy, the ridge of the whitened inputs.
    M = ridge_weights(white @ cxx @ white, white @ cxy, lam / n)
    return _map_and_intercept(white @ M, mx, my, X)


def procrustes_fit(X: torch.Tensor, Y: torch.Tensor, whiten_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Whiten both sides, map orthogonally, re-colour into the target space (as VecMap, Artetxe et al. 2018).

    Q = U V^T from the SVD of the whitened cross-covariance Wx Cxy Wy; for Dx != Dy the reduced SVD gives a
    semi-orthogonal Q [Dx, Dy]. W = Wx Q Cy^(1/2) [Dx, Dy]. When Y = X R (R orthogonal) and eps -> 0, W = R exactly.
    """
    _check_fit_inputs(X, Y, whiten_eps)
    mx, my, cxx, cxy, cyy = _moments(X, Y, with_cyy=True)
    white_x, _ = _sqrt_pair(cxx, whiten_eps)
    white_y, colour_y = _sqrt_pair(cyy, whiten_eps)
    U, _, Vh = torch.linalg.svd(white_x @ cxy @ white_y, full_matrices=False)
    return _map_and_intercept(white_x @ (U @ Vh) @ colour_y, mx, my, X)
