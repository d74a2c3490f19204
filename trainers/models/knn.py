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
from dataclasses import dataclass

import numpy as np
import torch

from latentsweep.trainers.config.tree import Config
from latentsweep.trainers.core.pages import take
from latentsweep.trainers.data.rows import STAT_COLUMNS
from latentsweep.trainers.eval import metrics
from latentsweep.trainers.eval.metrics import GALLERY_SIZE
from latentsweep.trainers.models.knn_memo import MEMO_ROWS, RowMemo, row_hashes  # noqa: F401 - MEMO_ROWS: its API
from latentsweep.trainers.models.model_context import ModelContext
from latentsweep.trainers.models.translator import Translator, l2_normalize

# Temperatures the leave-one-image-out choice tries when model.knn_tau = 0: 0.001 to 0.2, log-spaced by 1.5x.
# Cosines between captions span about [-0.2, 1]: below 0.001 the softmax is the nearest key alone, above 0.2 it
# is close to the plain mean of the k neighbours, and both ends are in the grid.
TAU_GRID = tuple(0.001 * 1.5 ** i for i in range(14))
# Training captions the choice scores (a seeded random subset): each costs one [N] similarity row. 2,048 queries give
# an MRR whose standard error (about 0.3 / sqrt(2048) = 0.007) is below the gaps between neighbouring temperatures.
CHOICE_QUERIES = 2048
# Query rows per block of the weighted mean of the neighbours' images: [BLOCK, k, Di] floats, 25 MB at k = 64 and
# 1536 dims (256 rows held 0.1 GB; each row's mean is the same either way).
BLOCK = 64
# Keys per block of `nearest`, made from the base's rows as read, and queries per similarity block against them:
# [KEY_BLOCK, Dt] unit keys and [QUERY_BLOCK, KEY_BLOCK] cosines, 16 MB each at 1024 dims (the whole [256, N] row
# block was 0.1 GB at challenge size, N = 100,000 training captions).
KEY_BLOCK = 4096
QUERY_BLOCK = 1024
# Rows a model predicts ahead of validation (`predict_ahead`): validation asks for 128 rows at a time, and each call of
# `nearest` reads every key, so a call should carry thousands of queries.
AHEAD_ROWS = 4096
_BUFFERS = ("key_base", "key_rows", "key_center", "key_mean", "key_image", "value_base", "value_rows", "tau")
# Rows `share_rows` compares before it reads another array as the model's keys and images (a few pages of each).
SHARE_PROBES = 16
# Norm floor when normalising (translator.l2_normalize's): a zero row stays zero.
_EPS = 1e-12
# The estimate's probe: one QUERY_BLOCK of random queries against one KEY_BLOCK of random keys through `nearest` (the
# keys' normalisation, the matmul and the top-k that are the model's cost), tens of ms on 2 cores at 1024 dims: long
# enough to time, short beside the minutes it predicts at challenge size (docs/trial-costs.md, "Real size").
PROBE_KEYS = KEY_BLOCK
# A prediction costs more than its `nearest`: the queries' normalisation, the softmax and the weighted mean of the
# neighbours' images. Measured at challenge size on 2 cores: translate 322 s, of which nearest 260 s (1.24).
TRANSLATE_OVER_NEAREST = 1.25
_MEMO_KEYS = ("memo_hash", "memo_pred")


class KernelTranslator(Translator):
    """raw = sum over the k most similar training captions of softmax(cos / tau) x unit image of that caption,
    minus model.knn_center x the mean unit training image.

    Keys are the training captions, centred by their own mean and L2-normalised ([N, Dt]); values the unit training
    images ([Ni, Di]) with each key's image index ([N]). Neither is held normalised: both are rows of the arrays the
    model was fit on (`Keys`, `Values`: the loaded data itself in a trial, 0.5 GB that a copy held at challenge
    size), normalised block by block as read, to the same values. With model.knn_tau = 0, tau is chosen when built
    by leave-one-image-out MRR on the training captions (choose_tau), which imitates retrieval of unseen images."""

    def __init__(self, cfg: Config, ctx: ModelContext):
        super().__init__(cfg.model.out_norm)
        self.k, self.center = cfg.model.knn_k, cfg.model.knn_center
        fit = ctx.take_fit_rows() if ctx.has_fit else None
        if fit is None:  # weights from a checkpoint: load_state_dict gives the buffers their sizes
            rows = torch.zeros(0, dtype=torch.long)
            keys = Keys(torch.zeros(0, ctx.dim_in), rows, torch.zeros(ctx.dim_in), torch.zeros(ctx.dim_in), rows)
            values, tau = Values(torch.zeros(0, ctx.dim_out), rows), 1.0
        else:
            keys = Keys.fit(fit.x.base, fit.x.index, fit.center.float(), fit.img.long())
            values = Values(fit.images.base, fit.images.index)
            tau = cfg.model.knn_tau or choose_tau(keys, values, self.k, cfg.train.seed, self.center)
        for name, value in zip(_BUFFERS, (*keys.buffers(), *values.buffers(), torch.tensor(float(tau)))):
            self.register_buffer(name, value)
        self.dim_out, self.memo, self.computed = ctx.dim_out, RowMemo(ctx.dim_out), 0  # computed: rows predicted
        self.shift: torch.Tensor | None = None  # center x the mean unit image [Di], made at the first prediction

    def keys(self) -> "Keys":
        return Keys(self.key_base, self.key_rows, self.key_center, self.key_mean, self.key_image)

    def values(self) -> "Values":
        return Values(self.value_base, self.value_rows)

    def share_rows(self, text: torch.Tensor, image: torch.Tensor) -> bool:
        """Read the keys from `text` [Nc, Dt] and the images from `image` [Ni, Di] from now on, instead of the arrays
        it holds (a checkpoint's, mapped from its file): the caller's loaded training data, which at challenge size
        is 0.67 GB that the checkpoint's copy would hold again once read. Taken (True) only when both have the shapes
        and dtypes of the held ones and the same values at SHARE_PROBES rows spread over each."""
        pairs = ((self.key_base, text), (self.value_base, image))
        if not all(_same_rows(mine, theirs.to(mine.device)) for mine, theirs in pairs):
            return False
        self.key_base, self.value_base = text.to(self.key_base.device), image.to(self.value_base.device)
        return True

    def translate(self, x: torch.Tensor) -> torch.Tensor:
        """[B, Dt] -> [B, Di]: rows this model predicted before (RowMemo, by content) are read, the rest computed."""
        x = x.float()
        if torch.compiler.is_compiling():  # torch.export traces the plain prediction: no memo, no Python state
            return self._blocks(x, self.center * self.values().mean())
        hashes = row_hashes(x)
        pos = self.memo.find(hashes).to(x.device)  # [B], -1 where not kept
        miss = torch.nonzero(pos < 0).flatten()
        if len(miss) == len(x):
            out = self._predict(x)
        else:
            out = self.memo.read(pos.clamp_min(0).cpu()).to(x.device)
            if len(miss):
                out[miss] = self._predict(x[miss])
        self.memo.add([hashes[i] for i in miss.tolist()], out[miss])
        return out

    def _predict(self, x: torch.Tensor) -> torch.Tensor:
        if self.shift is None or self.shift.device != self.value_base.device:  # once, not per block of queries
            self.shift = self.center * self.values().mean()  # [Di]
        self.computed += len(x)
        return self._blocks(x, self.shift)

    def _blocks(self, x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        """[B, Dt] -> [B, Di]: the kernel-weighted training images of each row's nearest captions, less `shift`."""
        keys, values = self.keys(), self.values()
        q = l2_normalize(x - self.key_mean)  # [B, Dt]
        sim, idx = nearest(q, keys, self.k)  # [B, k'] each
        # one output, filled block by block: a block's rows kept as they came would sit in glibc's heap between its
        # 25 MB neighbour blocks, freed in turn, and hold 0.1-0.3 GB of their holes (docs/memory.md, "sixth round")
        out = shift.new_empty(sim.shape[0], shift.shape[0])  # [B, Di]
        for s, i, o in zip(sim.split(BLOCK), idx.split(BLOCK), out.split(BLOCK)):
            w = torch.softmax(s / self.tau, dim=1)  # [b, k']
            o.copy_(torch.einsum("bk,bkd->bd", w, values.unit(keys.image[i])) - shift)  # [b, Di]
        return out

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.memo.n:  # the kept predictions travel with the checkpoint (a trial's val captions, for the pick)
            destination[prefix + "memo_hash"], destination[prefix + "memo_pred"] = self.memo.state()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        if prefix + "keys" in state_dict:  # written before the keys were rows: upgraded in this module's own dict
            _upgrade(state_dict, prefix)
        for name in _BUFFERS:  # sized by the training set, which a checkpoint-built model does not know
            if prefix + name in state_dict:
                given, mine = state_dict[prefix + name], getattr(self, name)
                # on the same device the checkpoint's tensor itself (mapped from the file by
                # latentsweep.trainers.train.checkpoint; copy_ into itself is a no-op): no second copy of the
                # training captions (0.5 GB at challenge size)
                setattr(self, name, given if given.device == mine.device and given.dtype == mine.dtype
                        else torch.empty_like(given, device=mine.device))
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        self.shift = None
        kept = [state_dict.get(prefix + key) for key in _MEMO_KEYS]  # absent from checkpoints before issue 38
        self.memo = RowMemo.of(*kept) if all(isinstance(t, torch.Tensor) for t in kept) else RowMemo(self.dim_out)
        unexpected_keys[:] = [key for key in unexpected_keys if key not in {prefix + k for k in _MEMO_KEYS}]


def _upgrade(state: dict, prefix: str) -> None:
    """A checkpoint of before the keys were rows held them centred and unit ([N, Dt] `keys`) and the unit images
    ([Ni, Di] `values`): as rows of themselves, centred by -key_mean so that `Keys` (which subtracts key_center,
    then key_mean) reads them back as they were, to a rounding, before normalising them again."""
    keys, values = state.pop(prefix + "keys"), state.pop(prefix + "values")
    state[prefix + "key_base"], state[prefix + "value_base"] = keys, values
    state[prefix + "key_rows"] = torch.arange(len(keys), device=keys.device)
    state[prefix + "key_center"] = -state[prefix + "key_mean"]
    state[prefix + "value_rows"] = torch.arange(len(values), device=values.device)


def _same_rows(mine: torch.Tensor, theirs: torch.Tensor) -> bool:
    """Whether `theirs` has mine's shape and dtype and equal values at SHARE_PROBES rows spread over it (reading a
    few pages of a mapped checkpoint, not the whole array)."""
    if mine.shape != theirs.shape or mine.dtype != theirs.dtype:
        return False
    rows = torch.linspace(0, max(len(mine) - 1, 0), min(SHARE_PROBES, len(mine))).long().to(mine.device)
    return bool(torch.equal(mine[rows], theirs[rows]))


@dataclass(frozen=True)
class Keys:
    """The model's N keys as rows of base [Nb, Dt]: key j is base[rows[j]] less `center` then `mean` [Dt],
    L2-normalised when read (`block`, `at`), with its image image[j] (an index into the Values). Each read gives the
    same values as the normalised copy of every key that the model once held, which is never made."""
    base: torch.Tensor
    rows: torch.Tensor  # int64 [N]
    center: torch.Tensor
    mean: torch.Tensor
    image: torch.Tensor  # int64 [N]

    @classmethod
    def fit(cls, base: torch.Tensor, rows: torch.Tensor, center: torch.Tensor, image: torch.Tensor) -> "Keys":
        """The keys of rows `rows` of `base` less `center`, centred by their own mean (taken here)."""
        return cls(base, rows, center, _column_mean(base, rows, center), image)

    @classmethod
    def plain(cls, x: torch.Tensor, image: torch.Tensor) -> "Keys":
        """Every row of x [N, Dt] a key, as it is (normalised when read)."""
        zeros = torch.zeros(x.shape[1], device=x.device)
        return cls(x, torch.arange(len(x), device=x.device), zeros, zeros, image)

    def __len__(self) -> int:
        return len(self.rows)

    def buffers(self) -> tuple[torch.Tensor, ...]:
        return self.base, self.rows, self.center, self.mean, self.image

    def at(self, pos: torch.Tensor) -> torch.Tensor:
        """Unit keys [n, Dt] at positions pos [n] (a new tensor, centred and normalised in place)."""
        x = take(self.base, self.rows[pos]).float().sub_(self.center).sub_(self.mean)  # read, never mapped (pages)
        return x.div_(x.norm(dim=1, keepdim=True).clamp_min(_EPS))

    def block(self, start: int, stop: int) -> torch.Tensor:
        return self.at(torch.arange(start, min(stop, len(self)), device=self.rows.device))


@dataclass(frozen=True)
class Values:
    """The unit training images as rows `rows` [Ni] of base [Nb, Di], L2-normalised when read."""
    base: torch.Tensor
    rows: torch.Tensor  # int64 [Ni]

    def __len__(self) -> int:
        return len(self.rows)

    def buffers(self) -> tuple[torch.Tensor, ...]:
        return self.base, self.rows

    def unit(self, idx: torch.Tensor) -> torch.Tensor:
        """Unit images [*idx.shape, Di] of image indices idx (any shape)."""
        x = take(self.base, self.rows[idx].reshape(-1)).view(*idx.shape, self.base.shape[1]).float()
        return x.div_(x.norm(dim=-1, keepdim=True).clamp_min(_EPS))

    def mean(self) -> torch.Tensor:
        """The mean unit image [Di], bit-identical to the mean of their normalised copy (by columns on the CPU, as
        latentsweep.trainers.data.rows.Rows.column_stat)."""
        if not len(self):
            return torch.zeros(self.base.shape[1], device=self.base.device)
        norms = torch.cat([take(self.base, self.rows[s:s + KEY_BLOCK]).float().norm(dim=1)
                           for s in range(0, len(self), KEY_BLOCK)]).clamp_min(_EPS)  # [Ni]
        return _column_mean(self.base, self.rows, torch.zeros(self.base.shape[1], device=self.base.device), norms)


def _column_mean(base: torch.Tensor, rows: torch.Tensor, center: torch.Tensor,
                 norms: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over rows [N] of (base[rows] - center) / norms[:, None] ([Dt]): STAT_COLUMNS columns at a time on the CPU,
    where a column's mean depends only on that column's values (tests/test_rows.py), so no [N, Dt] copy is made;
    whole elsewhere (device memory)."""
    def part(cols: slice) -> torch.Tensor:
        x = take(base, rows, cols).float() - center[cols]  # [N, c] read from the file where base is the sealed set
        return (x if norms is None else x / norms[:, None]).mean(dim=0)

    if not len(rows):
        return torch.zeros(base.shape[1], device=base.device)
    if base.device.type != "cpu":
        return part(slice(None))
    return torch.cat([part(slice(c, c + STAT_COLUMNS)) for c in range(0, base.shape[1], STAT_COLUMNS)])


def choose_tau(keys: Keys, values: Values, k: int, seed: int, center: float = 0.0) -> float:
    """The TAU_GRID temperature with the best leave-one-image-out MRR (`loio_mrr`). With one image there is nothing
    to leave out: tau = the grid's middle."""
    if len(values) < 2:
        return TAU_GRID[len(TAU_GRID) // 2]
    return TAU_GRID[int(torch.argmax(loio_mrr(keys, values, k, seed, center)))]


def loio_mrr(keys: Keys, values: Values, k: int, seed: int, center: float) -> torch.Tensor:
    """Leave-one-image-out MRR [len(TAU_GRID)] at each grid temperature: up to CHOICE_QUERIES training captions, each
    translated from the other images' captions only (less `center` x the mean unit image, as the model predicts),
    ranked against a gallery of GALLERY_SIZE training images as on the leaderboard (its own image and random
    others), under latentsweep.trainers.eval.metrics' rank rule. Two images at least."""
    device = keys.rows.device
    gen = torch.Generator().manual_seed(seed)
    queries = torch.randperm(len(keys), generator=gen)[:CHOICE_QUERIES].to(device)
    gallery = torch.randperm(len(values), generator=gen)[:GALLERY_SIZE].to(device)  # [G]
    gallery_unit, mean = values.unit(gallery), values.mean()  # [G, Di], [Di]
    rr = torch.zeros(len(TAU_GRID), device=device)
    # [Ni] each image's score against the mean image (the shift's part), a block of images at a time
    mean_score = torch.cat([values.unit(b) @ mean for b in torch.arange(len(values), device=device).split(KEY_BLOCK)])
    own_images = keys.image[queries]  # [Q]
    sims, idxs = nearest(keys.at(queries), keys, k, exclude=own_images)  # [Q, k'] each: every key read once
    for sim, idx, own in zip(sims.split(BLOCK), idxs.split(BLOCK), own_images.split(BLOCK)):
        neighbours = values.unit(keys.image[idx])  # [b, k', Di]
        own_score = torch.einsum("bkd,bd->bk", neighbours, values.unit(own))  # [b, k'] each neighbour's image vs own
        gal_score = torch.einsum("bkd,gd->bkg", neighbours, gallery_unit)  # [b, k', G]
        rivals = gallery[None, :] != own[:, None]  # [b, G]: the gallery without the query's own image
        for t, tau in enumerate(TAU_GRID):
            w = torch.softmax(sim / tau, dim=1)  # [b, k']
            mine = (w * own_score).sum(1) - center * mean_score[own]  # [b]
            others = torch.einsum("bk,bkg->bg", w, gal_score) - center * mean_score[gallery]  # [b, G]
            rr[t] += (1.0 / metrics.rank_against(others, mine[:, None], rivals).float()).sum()
    return rr / len(queries)


def nearest(q: torch.Tensor, keys: Keys, k: int, exclude: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(cosines [b, k'], key positions [b, k']) of the k' = min(k, N) keys nearest to the unit queries q [b, Dt],
    best first; `exclude` [b]: an image per query whose captions are left out (-inf, weight 0 in a softmax).

    Keys are read KEY_BLOCK at a time (`Keys.block`: gathered, centred, normalised), each once for every query of
    the call, against QUERY_BLOCK queries at a time; each block's k best are merged into the running k best. A call
    reads every key, so its cost beside the product is paid once per call: callers pass thousands of queries."""
    k = min(k, len(keys))
    blocks, banned = q.split(QUERY_BLOCK), (None if exclude is None else exclude.split(QUERY_BLOCK))
    # (b.shape[0], not len(b): torch.export keeps the batch symbolic)
    best = [(b.new_zeros(b.shape[0], 0), torch.zeros(b.shape[0], 0, dtype=torch.long, device=b.device)) for b in blocks]
    for start in range(0, len(keys), KEY_BLOCK):
        unit = keys.block(start, start + KEY_BLOCK)  # [c, Dt]
        image = keys.image[start:start + len(unit)]  # [c]
        for j, block in enumerate(blocks):
            sim = block @ unit.T  # [qb, c]
            if banned is not None:  # in place: a second block is as large
                sim.masked_fill_(image[None, :] == banned[j][:, None], -math.inf)
            value, pos = sim.topk(min(k, len(unit)), dim=1)
            kept_value, kept_pos = best[j]
            value, order = torch.cat([kept_value, value], 1).topk(min(k, kept_value.shape[1] + value.shape[1]), dim=1)
            best[j] = value, torch.cat([kept_pos, pos + start], 1).gather(1, order)
    return torch.cat([v for v, _ in best]), torch.cat([p for _, p in best])


def predict_ahead(model: torch.nn.Module, x) -> None:
    """Predict x [N, Dt] (a tensor or latentsweep.trainers.data.rows.Rows) with `model` (a knn model, or one
    wrapping it), AHEAD_ROWS rows a call, keeping nothing but what the knn model's memo keeps: validation then reads
    its 128-row blocks from the memo instead of reading every key for each."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for start in range(0, len(x), AHEAD_ROWS):
                model(x[start:start + AHEAD_ROWS])
    finally:
        model.train(was_training)


def build_seconds(cfg: Config, data, device: torch.device | str = "cpu") -> float:
    """Estimated seconds of building and validating cfg's knn model on `data` (a TrainSet) on `device` now: (query,
    key) pairs times the seconds a pair costs, timed on this machine under its present load (`probe_pair_s`).

    Its cost grows with the captions squared: the temperature choice (CHOICE_QUERIES queries against the N training
    captions), every val caption against the N keys, and validation's cosines of the val captions against every val
    image (counted as pairs of Di / Dt keys' work). At challenge size (N = 100,000, 25,000 val captions) that is
    2.7e9 pairs, minutes on 2 cores, where the demo's are under a second."""
    from latentsweep.trainers.train.tasks import split_images  # it builds models: imported here, not at load time

    train_img, val_img = split_images(cfg, data)
    per_image = np.bincount(np.asarray(data.cap2img), minlength=len(data.image))
    n_keys, n_val = int(per_image[train_img].sum()), int(per_image[val_img].sum())
    dim_in, dim_out = data.text.shape[1], data.image.shape[1]
    pairs = (min(CHOICE_QUERIES, n_keys) + TRANSLATE_OVER_NEAREST * n_val) * n_keys \
        + n_val * len(val_img) * dim_out / dim_in
    return pairs * probe_pair_s(dim_in, cfg.model.knn_k, device)


def probe_pair_s(dim: int, k: int, device: torch.device | str = "cpu") -> float:
    """Seconds per (query, key) pair of `nearest` at `dim` dims on `device`, timed now on QUERY_BLOCK x PROBE_KEYS
    (after one untimed call, which pays the first call's set-up)."""
    gen = torch.Generator().manual_seed(0)
    q = l2_normalize(torch.randn(QUERY_BLOCK, dim, generator=gen)).to(device)
    raw = torch.randn(PROBE_KEYS, dim, generator=gen).to(device)
    keys = Keys.plain(raw, torch.arange(PROBE_KEYS, device=raw.device))
    nearest(q, keys, k)
    _sync(raw.device)
    started = time.perf_counter()
    nearest(q, keys, k)
    _sync(raw.device)
    return (time.perf_counter() - started) / (QUERY_BLOCK * PROBE_KEYS)


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
