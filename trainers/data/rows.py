"""Rows: a subset of a matrix's rows read in place (gathered per batch), never copied whole."""
from __future__ import annotations

from typing import Callable

import torch

from latentsweep.trainers.core.pages import take

# Columns per block of a column statistic: a [N, 128] float32 block of 112,500 challenge-size training captions
# is 58 MB, against 460 MB for the whole [N, 1024] copy.
STAT_COLUMNS = 128


class Rows:
    """base[index] ([N, D]) without the copy: `rows[idx]` gathers the rows a batch needs (a [len(idx), D] tensor
    equal to base[index][idx]). On the CPU `base` may share the loaded numpy array's memory, so the task holds
    only its index [N] besides the data: at challenge size 8 bytes per caption instead of 4 KB. Where base is the
    train set's sealed mapping, rows are read from its file (`latentsweep.trainers.core.pages.take`), so an epoch's
    scattered reads map none of the captions' pages (a mapped read maps 2 MB around each row on Linux 6.18)."""

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
        return take(self.base, self.index[idx])

    def materialize(self) -> torch.Tensor:
        """The whole subset, [N, D] (a copy: for the callers that need every row at once)."""
        return take(self.base, self.index)

    def column_stat(self, stat: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """stat(subset) for a per-column statistic ([N, D] -> [D], e.g. mean over dim 0), one block of columns at a
        time. On the CPU a column's result depends only on that column's values in row order, so this is
        bit-identical to stat(self.materialize()) (tests/test_rows.py); on other devices the reduction's split
        depends on the width, so the whole subset is gathered there (device memory, not the host's)."""
        if self.base.device.type != "cpu":
            return stat(self.materialize())
        width = self.base.shape[1]
        return torch.cat([stat(take(self.base, self.index, slice(c, c + STAT_COLUMNS)))
                          for c in range(0, width, STAT_COLUMNS)])


def column_stat(x: torch.Tensor | Rows, stat: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """stat(x) for a tensor, Rows.column_stat for a row subset."""
    return x.column_stat(stat) if isinstance(x, Rows) else stat(x)
