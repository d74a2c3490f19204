"""The kernel model (model.kind = "knn"): a caption's image embedding as the softmax-weighted mean of the images of
its nearest training captions (Nadaraya-Watson regression). Fitted when built, nothing trained.

Why a model with no weights: with a few thousand training images a learned map is data-starved, and the images
of similar training captions carry what it cannot learn. Its errors differ from a trained model's, so it pays as an
ensemble member (docs/results.md: measured on the demo holdouts) even where it is weaker alone.

Why centred: a weighted mean of unit images leans towards their mean, so the images near that mean (hubs) rank
high for every query. Taking model.knn_center x the mean unit training image off each prediction ranks by
p.g - c * mean.g instead: on the 5 demo holdouts (5,898 test captions) the knn alone scored 0.421 at c = 1 against
0.397 at c = 0, +0.024 [+0.019, +0.028] paired (tau chosen under each). A trained model needs no such term: its
output bias can learn one, and the same centring of the reference MLP's predictions measured -0.029 there.
"""
from __future__ import annotations

import math
import time

import numpy as np
import torch

from latentsweep.trainers.config.tree import Config
from latentsweep.trainers.eval import metrics
from latentsweep.trainers.eval.metrics import GALLERY_SIZE
from latentsweep.trainers.models.model_context import FitSet, ModelContext
from latentsweep.trainers.models.translator import Translator, l2_normalize

# Temperatures the leave-one-image-out choice tries when model.knn_tau = 0: 0.001 to 0.2, log-spaced by 1.5x.
# Cosines between captions span about [-0.2, 1]: below 0.001 the softmax is the nearest key alone, above 0.2 it
# is close to the plain mean of the k neighbours, and both ends are in the grid.
TAU_GRID = tuple(0.001 * 1.5 ** i for i in range(14))
# Training captions the choice scores (a seeded random subset): each costs one [N] similarity row. 2,048 queries give
# an MRR whose standard error (about 0.3 / sqrt(2048) = 0.007) is below the gaps between neighbouring temperatures.
CHOICE_QUERIES = 2048
# Query rows per similarity block, at inference and in the choice: [BLOCK, N] floats, 128 MB at challenge size
# (N = 100,000 training captions).
BLOCK = 256
_BUFFERS = ("key_mean", "keys", "key_image", "values", "tau")
# Keys of the estimate's probe: one BLOCK of queries against this many random keys, through `nearest` (the matmul and
# the top-k that are the model's cost), 10-30 ms on 2 cores at 1024 dims: long enough to time, short beside the
# minutes it predicts at challenge size (docs/trial-costs.md, "Real size").
PROBE_KEYS = 8192
# A prediction costs more than its `nearest`: the queries' normalisation, the softmax and the weighted mean of the
# neighbours' images. Measured at challenge size on 2 cores: translate 322 s, of which nearest 260 s (1.24).
TRANSLATE_OVER_NEAREST = 1.25
# Predictions a knn model keeps by row (RowMemo), and saves in its checkpoint: a one-budget run predicts the same val
# captions up to four times (the trial's validation, the keeper's and the gate's scores, the pick's selection), each
# time 100,000 key cosines a caption at challenge size (its 25,000 val captions: 5 TFLOP, minutes on 2 cores), while
# a kept row costs its Di floats (0.15 GB for those captions at 1536 dims). Enough rows for the val captions.
MEMO_ROWS = 32768
_MEMO_KEYS = ("memo_hash", "memo_pred")


class KernelTranslator(Translator):
    """raw = sum over the k most similar training captions of softmax(cos / tau) x unit image of that caption,
    minus model.knn_center x the mean unit training image.

    Keys are the training captions, centred by their own mean and L2-normalised ([N, Dt]); values the unit training
    images ([Ni, Di]) with each key's image index ([N]). With model.knn_tau = 0, tau is chosen when built by
    leave-one-image-out MRR on the training captions (choose_tau), which imitates retrieval of unseen images."""

    def __init__(self, cfg: Config, ctx: ModelContext):
        super().__init__(cfg.model.out_norm)
        self.k, self.center = cfg.model.knn_k, cfg.model.knn_center
        fit = ctx.take_fit_set() if ctx.has_fit else None
        if fit is None:  # weights from a checkpoint: load_state_dict gives the buffers their sizes
            mean, keys = torch.zeros(ctx.dim_in), torch.zeros(0, ctx.dim_in)
            img, values, tau = torch.zeros(0, dtype=torch.long), torch.zeros(0, ctx.dim_out), 1.0
        else:
            mean, keys = _unit_keys(fit.x, fit.owned)
            img, values = fit.img.long(), l2_normalize(fit.images.float())
            del fit  # an owned fit set's captions are the keys now; its raw images are freed here
            tau = cfg.model.knn_tau or choose_tau(FitSet(keys, img, values), self.k, cfg.train.seed, self.center)
        for name, value in zip(_BUFFERS, (mean, keys, img, values, torch.tensor(float(tau)))):
            self.register_buffer(name, value)
        self.dim_out, self.memo, self.computed = ctx.dim_out, RowMemo(ctx.dim_out), 0  # computed: rows predicted
        self.shift: torch.Tensor | None = None  # center x the mean unit image [Di], made at the first prediction

    def translate(self, x: torch.Tensor) -> torch.Tensor:
        """[B, Dt] -> [B, Di]: rows this model predicted before (RowMemo, by content) are read, the rest computed."""
        x = x.float()
        if torch.compiler.is_compiling():  # torch.export traces the plain prediction: no memo, no Python state
            return self._blocks(x, self.center * self.values.mean(dim=0))
        hashes = row_hashes(x)
        pos = self.memo.find(hashes).to(x.device)  # [B], -1 where not kept
        miss = torch.nonzero(pos < 0).flatten()
        if len(miss) == len(x):
            out = self._predict(x)
        else:
            out = self.memo.rows[pos.clamp_min(0).cpu()].to(x.device)
            if len(miss):
                out[miss] = self._predict(x[miss])
        self.memo.add([hashes[i] for i in miss.tolist()], out[miss])
        return out

    def _predict(self, x: torch.Tensor) -> torch.Tensor:
        if self.shift is None or self.shift.device != self.values.device:  # once, not per block of queries
            self.shift = self.center * self.values.mean(dim=0)  # [Di]
        self.computed += len(x)
        return self._blocks(x, self.shift)

    def _blocks(self, x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        """[B, Dt] -> [B, Di]: the kernel-weighted training images of each row's nearest captions, less `shift`."""
        q = l2_normalize(x - self.key_mean)  # [B, Dt]
        out = [self.values.new_zeros(0, self.values.shape[1])]
        for block in q.split(BLOCK):
            sim, idx = nearest(block, self.keys, self.key_image, self.k)
            w = torch.softmax(sim / self.tau, dim=1)  # [b, k]
            out.append(torch.einsum("bk,bkd->bd", w, self.values[self.key_image[idx]]) - shift)  # [b, Di]
        return torch.cat(out)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.memo.n:  # the kept predictions travel with the checkpoint (a trial's val captions, for the pick)
            destination[prefix + "memo_hash"], destination[prefix + "memo_pred"] = self.memo.state()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        for name in _BUFFERS:  # sized by the training set, which a checkpoint-built model does not know
            if prefix + name in state_dict:
                given, mine = state_dict[prefix + name], getattr(self, name)
                # on the same device the checkpoint's tensor itself (mapped from the file by
                # latentsweep.trainers.train.checkpoint;
                # copy_ into itself is a no-op): no second 0.5 GB copy of the keys at challenge size
                setattr(self, name, given if given.device == mine.device and given.dtype == mine.dtype
                        else torch.empty_like(given, device=mine.device))
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        self.shift = None
        kept = [state_dict.get(prefix + key) for key in _MEMO_KEYS]  # absent from checkpoints before issue 38
        self.memo = RowMemo.of(*kept) if all(isinstance(t, torch.Tensor) for t in kept) else RowMemo(self.dim_out)
        unexpected_keys[:] = [key for key in unexpected_keys if key not in {prefix + k for k in _MEMO_KEYS}]


class RowMemo:
    """Output rows [n, Di] (float32, CPU) by the content hash of their input rows (`row_hashes`), at most MEMO_ROWS;
    the first ones kept (a trial's val captions come first)."""

    def __init__(self, dim_out: int):
        self.index: dict[int, int] = {}
        self.rows, self.n = torch.zeros(0, dim_out), 0

    @classmethod
    def of(cls, hashes: torch.Tensor, rows: torch.Tensor) -> "RowMemo":
        """The memo saved as (hashes [n], rows [n, Di]): `rows` kept as given (a checkpoint's, mapped from its file),
        copied only if rows are added."""
        memo = cls(rows.shape[1])
        n = min(len(hashes), MEMO_ROWS)
        memo.rows, memo.n = rows[:n].float().cpu(), n
        memo.index.update(zip(hashes[:n].tolist(), range(n)))
        return memo

    def find(self, hashes: list[int]) -> torch.Tensor:
        """Each hash's row [B] (int64), -1 where not kept."""
        return torch.tensor([self.index.get(h, -1) for h in hashes], dtype=torch.long)

    def add(self, hashes: list[int], rows: torch.Tensor) -> None:
        take = min(len(hashes), MEMO_ROWS - self.n)
        if take <= 0:
            return
        if self.n + take > len(self.rows):  # grown by doubling: appending costs O(rows) in all
            grown = torch.empty(min(MEMO_ROWS, max(2 * len(self.rows), self.n + take)), self.rows.shape[1])
            grown[:self.n] = self.rows[:self.n]
            self.rows = grown
        self.rows[self.n:self.n + take] = rows[:take].detach().float().cpu()
        self.index.update(zip(hashes[:take], range(self.n, self.n + take)))
        self.n += take

    def state(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(hashes [n] int64, rows [n, Di]) in row order, for a checkpoint."""
        hashes = torch.empty(self.n, dtype=torch.long)
        for h, i in self.index.items():
            hashes[i] = h
        return hashes, self.rows[:self.n].clone()


_HASH_WEIGHTS: dict[tuple[int, str], torch.Tensor] = {}


def row_hashes(x: torch.Tensor) -> list[int]:
    """A 64-bit hash of each row's float32 bits [B]: the bits times fixed random odd int64 weights, summed (wrapping),
    on the rows' device. Two different rows collide with odds about 2^-60; equal rows always agree."""
    key = (x.shape[1], str(x.device))
    if key not in _HASH_WEIGHTS:
        gen = torch.Generator().manual_seed(x.shape[1])
        _HASH_WEIGHTS[key] = (torch.randint(-2 ** 62, 2 ** 62, (x.shape[1],), generator=gen) | 1).to(x.device)
    bits = x.contiguous().view(torch.int32).long()  # [B, Dt]
    return (bits * _HASH_WEIGHTS[key]).sum(dim=1).tolist()


def choose_tau(fit: FitSet, k: int, seed: int, center: float = 0.0) -> float:
    """The TAU_GRID temperature with the best leave-one-image-out MRR (`loio_mrr`). With one image there is nothing
    to leave out: tau = the grid's middle."""
    if fit.images.shape[0] < 2:
        return TAU_GRID[len(TAU_GRID) // 2]
    return TAU_GRID[int(torch.argmax(loio_mrr(fit, k, seed, center)))]


def loio_mrr(fit: FitSet, k: int, seed: int, center: float) -> torch.Tensor:
    """Leave-one-image-out MRR [len(TAU_GRID)] at each grid temperature: up to CHOICE_QUERIES training captions, each
    translated from the other images' captions only (less `center` x the mean unit image, as the model predicts),
    ranked against a gallery of GALLERY_SIZE training images as on the leaderboard (its own image and random
    others), under latentsweep.trainers.eval.metrics' rank rule. fit: unit keys, their images, unit images; two images at least."""
    keys, img, values = fit.x, fit.img, fit.images
    gen = torch.Generator().manual_seed(seed)
    queries = torch.randperm(keys.shape[0], generator=gen)[:CHOICE_QUERIES].to(keys.device)
    gallery = torch.randperm(values.shape[0], generator=gen)[:GALLERY_SIZE].to(keys.device)  # [G]
    rr = torch.zeros(len(TAU_GRID), device=keys.device)
    mean_score = values @ values.mean(dim=0)  # [Ni] each image's score against the mean image (the shift's part)
    for q in queries.split(BLOCK):
        own = img[q]  # [b]
        sim, idx = nearest(keys[q], keys, img, k, exclude=own)
        neighbours = values[img[idx]]  # [b, k', Di]
        own_score = torch.einsum("bkd,bd->bk", neighbours, values[own])  # [b, k'] each neighbour's image vs own
        gal_score = torch.einsum("bkd,gd->bkg", neighbours, values[gallery])  # [b, k', G]
        rivals = gallery[None, :] != own[:, None]  # [b, G]: the gallery without the query's own image
        for t, tau in enumerate(TAU_GRID):
            w = torch.softmax(sim / tau, dim=1)  # [b, k']
            mine = (w * own_score).sum(1) - center * mean_score[own]  # [b]
            others = torch.einsum("bk,bkg->bg", w, gal_score) - center * mean_score[gallery]  # [b, G]
            rr[t] += (1.0 / metrics.rank_against(others, mine[:, None], rivals).float()).sum()
    return rr / len(queries)


def _unit_keys(x: torch.Tensor, owned: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean [Dt], the centred unit keys [N, Dt]), made in place in x when the fit set was made for this build
    (`owned`: at challenge size a copy is 0.4 GB), else in one new tensor (a task may hold the captions it gave)."""
    mean = x.float().mean(dim=0)
    keys = x.float().sub_(mean) if owned else x.float() - mean
    keys.div_(keys.norm(dim=1, keepdim=True).clamp_min(1e-12))
    return mean, keys


def nearest(q: torch.Tensor, keys: torch.Tensor, key_image: torch.Tensor, k: int,
            exclude: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(cosines [b, k'], key indices [b, k']) of the k' = min(k, N) keys [N, Dt] nearest to the unit queries
    q [b, Dt]; `exclude` [b]: an image per query whose captions are left out (-inf, weight 0 in a softmax)."""
    sim = q @ keys.T  # [b, N]
    if exclude is not None:  # in place: a second [b, N] block is 0.1 GB at challenge size
        sim.masked_fill_(key_image[None, :] == exclude[:, None], -math.inf)
    return sim.topk(min(k, sim.shape[1]), dim=1)


def build_seconds(cfg: Config, data, device: torch.device | str = "cpu") -> float:
    """Estimated seconds of building and validating cfg's knn model on `data` (a TrainSet) on `device` now: (query,
    key) pairs times the seconds a pair costs, timed on this machine under its present load (`probe_pair_s`).

    Its cost grows with the captions squared: the temperature choice (CHOICE_QUERIES queries against the N training
    captions), every val caption against the N keys, and validation's cosines of the val captions against every val
    image (counted as pairs of Di / Dt keys' work). At challenge size (N = 100,000, 25,000 val captions) that is
    2.7e9 pairs, minutes on 2 cores, where the demo's are under a second."""
    # latentsweep.trainers.train.tasks builds models: imported when needed, not at load time
    from latentsweep.trainers.train.tasks import (
        split_images,
    )

    train_img, val_img = split_images(cfg, data)
    per_image = np.bincount(np.asarray(data.cap2img), minlength=len(data.image))
    n_keys, n_val = int(per_image[train_img].sum()), int(per_image[val_img].sum())
    dim_in, dim_out = data.text.shape[1], data.image.shape[1]
    pairs = (min(CHOICE_QUERIES, n_keys) + TRANSLATE_OVER_NEAREST * n_val) * n_keys \
        + n_val * len(val_img) * dim_out / dim_in
    return pairs * probe_pair_s(dim_in, cfg.model.knn_k, device)


def probe_pair_s(dim: int, k: int, device: torch.device | str = "cpu") -> float:
    """Seconds per (query, key) pair of `nearest` at `dim` dims on `device`, timed now on one BLOCK x PROBE_KEYS
    block (after one untimed call, which pays the first call's set-up)."""
    gen = torch.Generator().manual_seed(0)
    q = l2_normalize(torch.randn(BLOCK, dim, generator=gen)).to(device)
    keys = l2_normalize(torch.randn(PROBE_KEYS, dim, generator=gen)).to(device)
    img = torch.arange(PROBE_KEYS, device=keys.device)
    nearest(q, keys, img, k)
    _sync(keys.device)
    started = time.perf_counter()
    nearest(q, keys, img, k)
    _sync(keys.device)
    return (time.perf_counter() - started) / (BLOCK * PROBE_KEYS)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_fits(cfg: Config, data, deadline) -> None:
    """Raise latentsweep.trainers.train.run.DeadlineReached, before anything is built, when cfg's knn model would not be
    built and
    validated before `deadline` (a latentsweep.trainers.core.deadline.Deadline; unbounded: nothing to check). Start
    nothing that
    cannot finish: a knn model has no epoch to stop after, so once started it runs to its end."""
    if cfg.model.kind != "knn" or not deadline.bounded:
        return
    from latentsweep.trainers.core.devices import resolve_device
    from latentsweep.trainers.core.deadline import DeadlineReached

    seconds = build_seconds(cfg, data, resolve_device(cfg.train.device))
    if not deadline.fits(seconds):
        raise DeadlineReached(f"the knn model's estimated {seconds:.0f} s (its cost grows with the captions squared) "
                              f"do not fit in the {deadline.left():.0f} s left")
