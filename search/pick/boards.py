"""The pick's selection on similarities: each member's val predictions ranked once against the leaderboard galleries
of every image set a choice is made or scored on (a `Board`), as the member is predicted, so the members are never
held together: a board keeps S floats a caption of each member (S = 100) where its rows were D (1536 at challenge
size), and a choice sums [n, S] similarities instead of [n, D] rows."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from latentsweep.trainers.data.splits import captions_and_local_images
from latentsweep.trainers.eval.metrics import (GALLERY_SIZE, average_views, caption_galleries, gallery_norms,
                                               leaderboard_galleries, rank_against)


class Board:
    """The captions of `images` (rows `caps` of the members' arrays, ascending) ranked against image_emb[images] in
    leaderboard galleries of min(GALLERY_SIZE, len(images)) images: `oof.images_scorer`'s galleries, views and rank
    rule, and its degenerate rows (a caption whose image is unusable, or whose combined prediction is, gets the worst
    rank).

    Each `add`ed member leaves its similarities here, [n, S] float32 (a caption against its own gallery, divided by
    the gallery images' norms as the metrics divide them), and which of its rows are finite and non-zero. `score`
    ranks a combination of them: the combined row's norm is one positive factor per caption, so leaving it out
    changes no rank (to float rounding: the products are summed after the dot products instead of before)."""

    def __init__(self, images: np.ndarray, image_emb: np.ndarray, cap2img: np.ndarray, seed: int = 0):
        self.images, self.image_emb = np.asarray(images, np.int64), image_emb  # [Ni], [*, D] (read, not copied)
        self.caps, local = captions_and_local_images(cap2img, self.images)  # [n] rows, [n] index into images
        size = min(GALLERY_SIZE, len(self.images))
        self.galleries, self.owner, self.views = leaderboard_galleries(local, len(self.images), size, seed)
        self.where = caption_galleries(self.galleries, self.owner, local, len(self.images))
        self.column = torch.from_numpy(self.where.column)[:, None]  # [n, 1] each caption's image in its gallery
        gallery = torch.from_numpy(np.ascontiguousarray(image_emb[self.images], np.float32))  # [Ni, D] a copy
        self.norms, usable = gallery_norms(gallery)  # [Ni] each image's, for every member's similarities
        del gallery
        self.target_ok = usable[torch.from_numpy(local)]  # [n]
        self.sims: list[np.ndarray] = []  # per member float32 [n, S]
        self.finite: list[torch.Tensor] = []  # per member bool [n]
        self.nonzero: list[torch.Tensor] = []  # per member bool [n]

    def __len__(self) -> int:
        """Members added."""
        return len(self.sims)

    def add(self, member: np.ndarray) -> None:
        """Rank one member: its L2-normalised predictions [Q, D] (rows `caps` and each gallery's images read a
        gallery at a time)."""
        n, size = len(self.caps), self.galleries.shape[1]
        sims = np.empty((n, size), np.float32)
        finite, nonzero = torch.empty(n, dtype=torch.bool), torch.empty(n, dtype=torch.bool)
        for b, cols in enumerate(self.galleries):
            rows = self.where.order[self.where.bounds[b]:self.where.bounds[b + 1]]
            block = torch.from_numpy(np.take(member, self.caps[rows], axis=0))  # [m, D]
            images = torch.from_numpy(np.ascontiguousarray(self.image_emb[self.images[cols]], np.float32))  # [S, D]
            sims[rows] = (block @ images.T).div_(self.norms[torch.from_numpy(cols)]).numpy()  # [m, S]
            norm = torch.linalg.vector_norm(block, dim=1)
            finite[rows], nonzero[rows] = torch.isfinite(norm), norm > 0
        self.sims.append(sims)
        self.finite.append(finite)
        self.nonzero.append(nonzero)

    def score(self, picks: Sequence[int], weights: Sequence[float] | None = None) -> float:
        """Leaderboard MRR of the members `picks` combined (latentsweep.search.pick.ensemble.Score: summed in their
        order, or weighted as `combine` weights)."""
        picks = list(picks)
        if weights is None:
            used = picks
            total = self.sims[picks[0]].copy()
            for i in picks[1:]:
                total += self.sims[i]
        else:
            pairs = [(i, w) for i, w in zip(picks, weights) if w]
            used = [i for i, _ in pairs]
            total = np.zeros_like(self.sims[0])
            for i, w in pairs:
                total += np.float32(w) * self.sims[i]  # as `combine` sums
        ok = self.target_ok.clone()
        for i in used:
            ok &= self.finite[i]
        ok &= torch.stack([self.nonzero[i] for i in used]).any(0) if used else torch.zeros_like(ok)
        sims = torch.from_numpy(total)
        ranks = torch.where(ok, rank_against(sims, sims.gather(1, self.column)), self.galleries.shape[1])
        return average_views(ranks.numpy(), self.views, self.owner)["mrr"]


__all__ = ["Board"]
