"""What a model builder may look at besides the config (the dims and, built on first read, the training set)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from latentsweep.trainers.data.rows import Rows


@dataclass(frozen=True)
class FitSet:
    """The training split as the closed-form fits read it: x [N, dim_in] centred captions, img [N] each caption's
    image as an index into images [Ni, dim_out] (raw, unnormalised image embeddings)."""
    x: torch.Tensor
    img: torch.Tensor
    images: torch.Tensor
    owned: bool = False  # x and images were made for this build alone: a builder that takes them may overwrite them

    @classmethod
    def from_pairs(cls, x: torch.Tensor, y: torch.Tensor) -> "FitSet":
        """Pairs given row by row (x[i] -> y[i]): every row is its own image."""
        return cls(x, torch.arange(x.shape[0], device=x.device), y)


@dataclass(frozen=True)
class FitRows:
    """The training split as rows of the loaded arrays, nothing copied (the kernel model's keys and values): x
    [N, dim_in] training captions, which less `center` [dim_in] are a FitSet's x; img [N] each caption's image as
    an index into images [Ni, dim_out] (raw)."""
    x: Rows
    center: torch.Tensor
    img: torch.Tensor
    images: Rows

    @classmethod
    def of(cls, fit: FitSet) -> "FitRows":
        """A FitSet's tensors as rows of themselves (its captions already centred)."""
        x, images = fit.x, fit.images
        return cls(Rows(x, torch.arange(len(x), device=x.device)), torch.zeros(x.shape[1], dtype=x.dtype,
                                                                                device=x.device),
                   fit.img, Rows(images, torch.arange(len(images), device=images.device)))


class ModelContext:
    """What a builder may look at besides the config: the dims, and the training set that only the closed-form
    models read (geometry's fit, the relative model's anchors, the kernel model's keys): fit_x [N, dim_in] train-split
    inputs and fit_y [N, dim_out] each one's raw image embedding, or the whole FitSet (images by index, not repeated
    per caption: `fit_set`, `take_fit_set`), on the training device. A task passes `fit`, which builds the FitSet on
    first read (at challenge size fit_y alone is 0.7 GB that every other model would hold for nothing). None is given
    when weights come from a checkpoint (fits and anchor picks are skipped and left to `load_state_dict`)."""

    def __init__(self, dim_in: int, dim_out: int, fit_x: torch.Tensor | None = None,
                 fit_y: torch.Tensor | None = None, *, fit: Callable[[], FitSet] | None = None,
                 rows: Callable[[], FitRows] | None = None, device: torch.device | None = None):
        self.dim_in, self.dim_out = dim_in, dim_out
        self._set = FitSet.from_pairs(fit_x, fit_y) if fit_x is not None else None
        self._fit = fit
        self._rows = rows  # the same split as rows of the loaded arrays, where the task can give them
        self._pairs_y = fit_y
        self.device = fit_x.device if fit_x is not None else device  # where build_model puts the model

    @property
    def has_fit(self) -> bool:
        return self._set is not None or self._fit is not None or self._rows is not None

    def fit_set(self) -> FitSet | None:
        if self._set is None and self._fit is not None:
            self._set, self._fit = self._fit(), None
        return self._set

    def take_fit_set(self) -> FitSet | None:
        """The FitSet, which this context then forgets: freed as soon as the builder drops it (the knn model frees
        the captions, 0.4 GB at challenge size, before its temperature choice)."""
        fit = self.fit_set()
        self._set = self._pairs_y = None
        return fit

    def take_fit_rows(self) -> FitRows | None:
        """The training split as FitRows, which this context then forgets: the task's rows of the loaded arrays
        where it gave them (no copy), else the FitSet's tensors."""
        if self._rows is not None:
            rows, self._rows, self._fit = self._rows(), None, None
            self._set = self._pairs_y = None
            return rows
        fit = self.take_fit_set()
        return None if fit is None else FitRows.of(fit)

    @property
    def fit_x(self) -> torch.Tensor | None:
        s = self.fit_set()
        return None if s is None else s.x

    @property
    def fit_y(self) -> torch.Tensor | None:
        """[N, dim_out]: built once from the images on first read."""
        s = self.fit_set()
        if s is not None and self._pairs_y is None:
            self._pairs_y = s.images[s.img]
        return self._pairs_y


__all__ = ["FitRows", "FitSet", "ModelContext"]
