"""The knn model's kept predictions (RowMemo): its output rows by the content hash of their input rows, saved in its
checkpoint, so that the same val captions are predicted once in a one-budget run, not once per reader."""
from __future__ import annotations

import numpy as np
import torch

from latentsweep.trainers.core.pages import page_out

# Predictions a knn model keeps by row (RowMemo), and saves in its checkpoint: a one-budget run predicts the same val
# captions up to four times (the trial's validation, the keeper's and the gate's scores, the pick's selection), each
# time 100,000 key cosines a caption at challenge size (its 25,000 val captions: 5 TFLOP, minutes on 2 cores), while
# a kept row costs its Di floats (0.15 GB for those captions at 1536 dims). Enough rows for the val captions.
MEMO_ROWS = 32768
# Rows per block of `row_hashes`: its int64 products are [HASH_ROWS, Dt], 8 MB at 1024 dims (a 4,096-row call's were
# 34 MB twice over).
HASH_ROWS = 1024


class RowMemo:
    """Output rows [n, Di] (float32, CPU) by the content hash of their input rows (`row_hashes`), at most MEMO_ROWS;
    the first ones kept (a trial's val captions come first). Rows are held in a zero-filled buffer grown by doubling
    (`_zeros`: its unwritten tail is not resident) and saved as the view of their n rows: a checkpoint stores that
    buffer (its tail zeros, at most as many rows again) instead of a copy made at the save (0.15 GB at challenge
    size, held beside the memo while the knn trial saved)."""

    def __init__(self, dim_out: int):
        self.index: dict[int, int] = {}
        self.rows, self.n = torch.zeros(0, dim_out), 0

    @classmethod
    def of(cls, hashes: torch.Tensor, rows: torch.Tensor) -> "RowMemo":
        """The memo saved as (hashes [n], rows [n, Di]): `rows` kept as given (a checkpoint's, mapped from its file),
        copied only if rows are added."""
        memo = cls(rows.shape[1])
        n = min(len(hashes), MEMO_ROWS)
        memo.rows, memo.n, memo.loaded = rows[:n].float().cpu(), n, True
        memo.index.update(zip(hashes[:n].tolist(), range(n)))
        return memo

    loaded = False  # rows given by a checkpoint (mapped from its file: `read` hands their pages back)

    def read(self, pos: torch.Tensor) -> torch.Tensor:
        """The kept rows at positions pos [B] (each >= 0), a new [B, Di] tensor. A loaded memo's rows are read once
        by each reader (a pick's selection, its gate): their pages are handed back after the copy (`page_out`), so a
        knn candidate holds its val predictions once (the copy), not also as 0.15 GB of its checkpoint's pages."""
        out = self.rows[pos]
        if self.loaded and len(pos):
            page_out(self.rows[int(pos.min()):int(pos.max()) + 1])
        return out

    def find(self, hashes: list[int]) -> torch.Tensor:
        """Each hash's row [B] (int64), -1 where not kept."""
        return torch.tensor([self.index.get(h, -1) for h in hashes], dtype=torch.long)

    def add(self, hashes: list[int], rows: torch.Tensor) -> None:
        take = min(len(hashes), MEMO_ROWS - self.n)
        if take <= 0:
            return
        if self.n + take > len(self.rows):  # grown by doubling: appending costs O(rows) in all
            grown = _zeros(min(MEMO_ROWS, max(2 * len(self.rows), self.n + take)), self.rows.shape[1])
            grown[:self.n] = self.rows[:self.n]
            self.rows, self.loaded = grown, False  # the process's own memory now
        self.rows[self.n:self.n + take] = rows[:take].detach().float().cpu()
        self.index.update(zip(hashes[:take], range(self.n, self.n + take)))
        self.n += take

    def state(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(hashes [n] int64, rows [n, Di]) in row order, for a checkpoint: the rows a view of the memo's buffer,
        which later rows never overwrite (they go after the n rows, or into a new buffer)."""
        hashes = torch.empty(self.n, dtype=torch.long)
        for h, i in self.index.items():
            hashes[i] = h
        return hashes, self.rows[:self.n]


def _zeros(rows: int, dim: int) -> torch.Tensor:
    """float32 zeros [rows, dim] whose pages are mapped when first written (numpy's calloc), not when made: a memo's
    unwritten capacity holds no memory, and reads (a save) as zeros."""
    return torch.from_numpy(np.zeros((rows, dim), np.float32))


_HASH_WEIGHTS: dict[tuple[int, str], torch.Tensor] = {}


def row_hashes(x: torch.Tensor) -> list[int]:
    """A 64-bit hash of each row's float32 bits [B]: the bits times fixed random odd int64 weights, summed (wrapping),
    on the rows' device. Two different rows collide with odds about 2^-60; equal rows always agree."""
    key = (x.shape[1], str(x.device))
    if key not in _HASH_WEIGHTS:
        gen = torch.Generator().manual_seed(x.shape[1])
        _HASH_WEIGHTS[key] = (torch.randint(-2 ** 62, 2 ** 62, (x.shape[1],), generator=gen) | 1).to(x.device)
    hashes = []
    for block in x.contiguous().split(HASH_ROWS):  # int64 [HASH_ROWS, Dt] temporaries, not [B, Dt] ones
        hashes += (block.view(torch.int32).long() * _HASH_WEIGHTS[key]).sum(dim=1).tolist()
    return hashes
