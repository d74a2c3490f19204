"""The closed-form answer: a centred text->image ridge whose strength is chosen on a hash split of the training images
by leaderboard MRR, refitted on every labelled caption. Seconds on 2 cores at challenge size, no training loop."""
from __future__ import annotations

import numpy as np
import torch

from latentsweep.trainers.data.sets import TrainSet
from latentsweep.trainers.core.heap import release_free_heap
from latentsweep.trainers.core.pages import take
from latentsweep.trainers.eval.metrics import GALLERY_SIZE, caption_galleries, leaderboard_galleries, rank_against
from latentsweep.trainers.models.ridge import ALPHAS, Moments, Ridge, solve
from latentsweep.trainers.data.splits import captions_of, split_by_hash

# The held-out share of images the strength is chosen on (the trials' default data.val_ratio).
VAL_RATIO = 0.2
# Caption rows per block of the moment sums: [BLOCK, Dx] float32 at a time (32 MB at 1024 dims), never a float64 copy
# of the whole training set.
BLOCK = 8192


def moments(data: TrainSet, caps: np.ndarray, block: int = BLOCK) -> Moments:
    """The moment sums of captions `caps` paired with their images, in blocks of `block` rows.

    x^T y is summed per image: sum_c x_c^T y_img(c) = sum_i (sum of image i's captions)^T y_i, one [Ni, Dx] x [Ni, Dy]
    product instead of a [Nc, Dx] x [Nc, Dy] one: 5x fewer multiplies at 5 captions an image, and no [Nc, Dy] gather
    of the images (docs/trial-costs.md, "Real size")."""
    caps = np.asarray(caps, np.int64)
    dx, dy = data.text.shape[1], data.image.shape[1]
    imgs, inv = np.unique(np.asarray(data.cap2img)[caps], return_inverse=True)  # [Nu] images, [len(caps)] -> row
    per_image = torch.zeros(len(imgs), dx)  # [Nu, Dx] float32: each image's captions summed (a few per image)
    xx = torch.zeros(dx, dx, dtype=torch.float64)
    inv_t = torch.from_numpy(inv.reshape(-1).astype(np.int64))
    for start in range(0, len(caps), block):
        x = torch.from_numpy(np.ascontiguousarray(take(data.text, caps[start:start + block]), np.float32))  # [b, Dx]
        # float32 products of one block (4x faster than float64 on CPU), summed over blocks in float64
        xx += (x.T @ x).double()
        per_image.index_add_(0, inv_t[start:start + block], x)
    counts = torch.from_numpy(np.bincount(inv.reshape(-1), minlength=len(imgs)).astype(np.float64))  # [Nu]
    sx, sy, xy = (torch.zeros(d, dtype=torch.float64) for d in (dx, dy, (dx, dy)))
    for start in range(0, len(imgs), block):
        y = torch.from_numpy(np.ascontiguousarray(take(data.image, imgs[start:start + block]), np.float32))  # [b, Dy]
        sx += per_image[start:start + block].double().sum(0)  # summed here: 5x fewer rows than the captions
        sy += counts[start:start + block] @ y.double()
        xy += (per_image[start:start + block].T @ y).double()
    return Moments(len(caps), sx, sy, xx, xy)


def held_out_mrr(ridge: Ridge, text: np.ndarray, image: np.ndarray, cap2img: np.ndarray, seed: int = 0,
                 caps: np.ndarray | None = None) -> float:
    """held_out_rr's MRR alone."""
    return held_out_rr(ridge, text, image, cap2img, seed, caps)[1]


def held_out_rr(ridge: Ridge, text: np.ndarray, image: np.ndarray, cap2img: np.ndarray, seed: int = 0,
                caps: np.ndarray | None = None) -> tuple[np.ndarray, float]:
    """(each caption's reciprocal rank, float64 [Q]; the MRR): latentsweep.trainers.eval.metrics.evaluate_leaderboard's
    of `ridge`'s predictions of captions `text` [Q, Dx]
    (or of its rows
    `caps`, read in place gallery by gallery, never copied whole) against images `image` [G, Dy] (cap2img [Q]: each
    caption's row of `image`), computed inside each caption's gallery only.

    Why not evaluate_leaderboard: it ranks every caption against all G images too (the global protocol, from the
    same pass), 25,000 x 5,000 similarities per strength at challenge size (28 of the old answer's 60 s on 2 cores,
    docs/trial-costs.md). Here a gallery's similarities are (x_c - mx) (g~ W^T)^T + g~ my, g~ its S unit images:
    one [B * S, Dy] x [Dy, Dx] product and no [Q, Dy] predictions. Same galleries, views and rank rule; a zero or
    non-finite image never outranks and gets the worst rank as a target (metrics' rule); a prediction is never
    degenerate here (finite data, Npz.matrix, and a finite solve). Float32 arithmetic, as evaluate_leaderboard's."""
    galleries, owner, views = leaderboard_galleries(cap2img, len(image), GALLERY_SIZE, seed)
    caps = np.arange(len(cap2img)) if caps is None else np.asarray(caps)
    g = torch.from_numpy(np.ascontiguousarray(image, np.float32))
    norm = torch.linalg.vector_norm(g, dim=1)
    ok = torch.isfinite(norm) & (norm > 0)  # [G] usable images
    norm = torch.where(ok, norm, torch.full_like(norm, float("nan")))  # an unusable image's cosines are NaN
    where = caption_galleries(galleries, owner, cap2img, len(image))
    mx = ridge.mx.float()
    slots = torch.from_numpy(galleries.reshape(-1))
    gal = g[slots] / norm[slots, None]  # [B * S, Dy] unit images of the galleries
    # each gallery image through the map's transpose, in one product: [B, S, Dx] and the mean image's part [B, S]
    through = (gal @ ridge.W.float().T).view(*galleries.shape, -1)
    offset = (gal @ ridge.my.float()).view(galleries.shape)
    rr = np.zeros(len(cap2img))
    for b, cols in enumerate(galleries):
        rows = where.order[where.bounds[b]:where.bounds[b + 1]]
        if len(rows) == 0:
            continue
        xc = torch.from_numpy(np.ascontiguousarray(take(text, caps[rows]), np.float32)) - mx  # [n, Dx]
        sims = xc @ through[b].T + offset[b]  # [n, S]: cosine up to each query's norm
        target = torch.from_numpy(where.column[rows])[:, None]  # [n, 1]
        rank = rank_against(sims, sims.gather(1, target))
        rank = torch.where(ok[torch.from_numpy(cap2img[rows])], rank, len(cols))
        rr[rows] = 1.0 / rank.double().numpy()
    return rr, float(np.mean([rr[view[owner]].mean() for view in views]))


def fit_ridge(data: TrainSet, seed: int = 0) -> tuple[Ridge, dict[float, float]]:
    """(the ridge refitted on every caption at the best strength, {alpha: held-out MRR}). With fewer than two
    images on either side of the split, the middle strength is used without a choice."""
    fit_img, held_img = split_by_hash(data.image_names, VAL_RATIO, salt=f"closed-form{seed}")
    fit_caps, held_caps = captions_of(data.cap2img, fit_img), captions_of(data.cap2img, held_img)
    if len(fit_img) < 2 or len(held_img) < 2:
        return solve(moments(data, np.arange(len(data.cap2img))), ALPHAS[len(ALPHAS) // 2]), {}
    on_fit, on_held = moments(data, fit_caps), moments(data, held_caps)
    local = np.full(len(data.image), -1)
    local[held_img] = np.arange(len(held_img))
    held_image, held_local = take(data.image, held_img), local[data.cap2img[held_caps]]
    scores = {alpha: held_out_mrr(solve(on_fit, alpha), data.text, held_image, held_local, seed, caps=held_caps)
              for alpha in ALPHAS}
    best = max(ALPHAS, key=lambda a: scores[a])
    release_free_heap()  # the blocks and per-image sums, freed but kept resident by glibc (0.1 GB at challenge size)
    return solve(on_fit + on_held, best), scores


# the solver and its grid live in latentsweep.trainers.models.ridge; named here too as the floor is where callers look
# for them
__all__ = ["ALPHAS", "Moments", "Ridge", "fit_ridge", "held_out_mrr", "held_out_rr", "moments", "solve"]
