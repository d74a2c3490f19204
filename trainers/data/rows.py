"""Rows: a subset of a matrix's rows read in place (gathered per batch), never copied whole."""
from __future__ import annotations

from typing import Callable

import torch

from latentsweep.trainers.core.pages import drop

# Columns per block of a column statistic: a [N, 128] float32 block of 112,500 challenge-size training captions
# is 58 MB, against 460 MB for the whole [N, 1024] copy.
STAT_COLUMNS = 128
# Rows per read of `gather`: 4,096 rows of 1,024 float32 are 16 MB (with the kernel's fault-around, at most 0.25 GB
# of a mapping's pages a read).
GATHER_ROWS = 4096


class Rows:
    """base[index] ([N, D]) without the copy: `rows[idx]` gathers the rows a batch needs (a [len(idx), D] tensor
    equal to base[index][idx]). On the CPU `base` may share the loaded numpy array's memory, so the task holds
    only its index [N] besides the data: at challenge size 8 bytes per caption instead of 4 KB. After each read the
    base's pages are handed back (`latentsweep.trainers.core.pages.drop`: only where it is the train set's sealed
    mapping), so an epoch's scattered reads leave the process holding one read's pages, not every page of the
    captions (0.41 GB at challenge size)."""

    def __init__(self, base: torch.Tensor, index: torch.Tensor):
        self.base, self.index = base, index  # [M, D], int64 [N] on base's device

    def __len__(self) -> int:
        return len(self.index)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((len(self.index), self.base.shape[1]))

    @property
    def device(self) -> torch.device:
        return self.base.device

    @property
    def dtype(self) -> torch.dtype:
        return self.base.dtype

    def __getitem__(self, idx) -> torch.Tensor:
        """The rows at positions `idx` (slice or int64 tensor) of the subset, as a new [n, D] tensor."""
        return gather(self.base, self.index[idx])

    def materialize(self) -> torch.Tensor:
        """The whole subset, [N, D] (a copy: for the callers that need every row at once)."""
        return gather(self.base, self.index)

    def column_stat(self, stat: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """stat(subset) for a per-column statistic ([N, D] -> [D], e.g. mean over dim 0), one block of columns at a
        time. On the CPU a column's result depends only on that column's values in row order, so this is
        bit-identical to stat(self.materialize()) (tests/test_rows.py); on other devices the reduction's split
        depends on the width, so the whole subset is gathered there (device memory, not the host's)."""
        if self.base.device.type != "cpu":
            return stat(self.materialize())
        width = self.base.shape[1]
        return torch.cat([stat(gather(self.base, self.index, slice(c, c + STAT_COLUMNS)))
                          for c in range(0, width, STAT_COLUMNS)])


def gather(base: torch.Tensor, index: torch.Tensor, cols: slice = slice(None)) -> torch.Tensor:
    """base[index, cols] ([N, c], a new tensor), read GATHER_ROWS rows at a time on the CPU with the pages of each
    read handed back (`latentsweep.trainers.core.pages.drop`, where base is the train set's sealed mapping): the
    same values, without every page of the base resident at once (a column block reads a slice of every row, so
    all 0.41 GB of the challenge-size training captions' pages). Whole, in one read, on other devices."""
    if base.device.type != "cpu" or len(index) <= GATHER_ROWS:
        out = base[index, cols]
        drop(base)
        return out
    out = torch.empty((len(index), base[:0, cols].shape[1]), dtype=base.dtype)
    for start in range(0, len(index), GATHER_ROWS):
        out[start:start + GATHER_ROWS] = base[index[start:start + GATHER_ROWS], cols]
        drop(base)
    return out


def column_stat(x: torch.Tensor | Rows, stat: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """stat(x) for a tensor, Rows.column_stat for a row subset."""
    return x.column_stat(stat) if isinstance(x, Rows) else stat(x)
