"""The one ridge solver (a centred linear map from covariances, in float64) and the one grid of its strengths."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# Ridge strengths a choice is made among (the floor, latentsweep.trainers.models.closed_form, whose fit the demo card's
# baseline is),
# relative to the mean eigenvalue of the centred text covariance so that the grid holds for any embedding scale and
# row count: four decades; on the bundled demo data the floor chooses 0.01 (seed 0) and 0.001 (seeds 1 and 2).
ALPHAS = (0.001, 0.01, 0.1, 1.0)


def ridge_weights(cxx: torch.Tensor, cxy: torch.Tensor, shrink: float | torch.Tensor) -> torch.Tensor:
    """W [Dx, Dy] = (Cxx + shrink I)^-1 Cxy: the ridge map of centred inputs with covariance Cxx [Dx, Dx] and
    cross-covariance Cxy [Dx, Dy] (both divided by the row count, so `shrink` is per row)."""
    eye = torch.eye(cxx.shape[0], dtype=cxx.dtype, device=cxx.device)
    return torch.linalg.solve(cxx + shrink * eye, cxy)


@dataclass(frozen=True)
class Moments:
    """Sums over caption rows of x, y, x^T x and x^T y (float64), and the row count."""
    n: int
    sx: torch.Tensor  # [Dx]
    sy: torch.Tensor  # [Dy]
    xx: torch.Tensor  # [Dx, Dx]
    xy: torch.Tensor  # [Dx, Dy]

    def __add__(self, other: "Moments") -> "Moments":
        return Moments(self.n + other.n, self.sx + other.sx, self.sy + other.sy, self.xx + other.xx,
                       self.xy + other.xy)


@dataclass(frozen=True)
class Ridge:
    """x -> (x - mx) W + my, W [Dx, Dy]."""
    W: torch.Tensor
    mx: torch.Tensor
    my: torch.Tensor
    alpha: float

    def predict(self, x: np.ndarray) -> np.ndarray:
        """[N, Dx] -> [N, Dy] float32."""
        q = torch.from_numpy(np.asarray(x, np.float64))
        return ((q - self.mx) @ self.W + self.my).float().numpy()


def solve(m: Moments, alpha: float) -> Ridge:
    """The ridge of strength `alpha` x the mean eigenvalue of the centred text covariance."""
    mx, my = m.sx / m.n, m.sy / m.n
    cxx = m.xx / m.n - torch.outer(mx, mx)
    cxy = m.xy / m.n - torch.outer(mx, my)
    return Ridge(ridge_weights(cxx, cxy, alpha * torch.trace(cxx) / cxx.shape[0]), mx, my, alpha)


__all__ = ["ALPHAS", "Moments", "Ridge", "ridge_weights", "solve"]
