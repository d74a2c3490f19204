"""What a model builder may look at besides the config (the dims and, built on first read, the fit pairs)."""
from __future__ import annotations

from typing import Callable

import torch


class ModelContext:
    """What a builder may look at besides the config: the dims, and the fit pairs that only the closed-form geometry
    fit and the relative model's anchors read: fit_x [N, dim_in] train-split inputs and fit_y [N, dim_out] paired raw
    (unnormalised) image embeddings, on the training device. A task passes `fit`, which builds the pairs on first
    read: at challenge size they are 0.5 + 0.7 GB that every other model would hold for nothing. Neither is given
    when weights come from a checkpoint (fits and anchor picks are skipped and left to `load_state_dict`)."""

    def __init__(self, dim_in: int, dim_out: int, fit_x: torch.Tensor | None = None,
                 fit_y: torch.Tensor | None = None, *, fit: Callable[[], tuple] | None = None,
                 device: torch.device | None = None):
        self.dim_in, self.dim_out = dim_in, dim_out
        self._pairs = (fit_x, fit_y) if fit_x is not None else None
        self._fit = fit
        self.device = fit_x.device if fit_x is not None else device  # where build_model puts the model

    @property
    def has_fit(self) -> bool:
        return self._pairs is not None or self._fit is not None

    def _built(self) -> tuple:
        if self._pairs is None and self._fit is not None:
            self._pairs, self._fit = self._fit(), None
        return self._pairs or (None, None)

    @property
    def fit_x(self) -> torch.Tensor | None:
        return self._built()[0]

    @property
    def fit_y(self) -> torch.Tensor | None:
        return self._built()[1]


__all__ = ["ModelContext"]
