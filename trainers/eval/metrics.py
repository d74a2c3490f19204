"""The one metrics module: retrieval ranks, their summary, and the global and leaderboard evaluation protocols.

Rank rule (used everywhere in latentsweep):
    rank = 1 + number of gallery items whose cosine similarity to the query is STRICTLY higher than the true item's.
Ties therefore favour the true item: an exact duplicate of the true image never pushes it down. The true item's
similarity is gathered from the same similarity row that it is compared against, so float differences between two
computations can never make the true item "strictly higher than itself".

Degenerate rows (zero norm or any non-finite value): such a query, or a query whose true item is such a row, gets the
worst rank, the gallery size (with the tie rule above a zero query ties with everything and would otherwise score
rank 1); such a gallery row never counts as higher than the true item.

Protocols:
  * global: every caption is ranked against all images of the split.
  * leaderboard (imitates the challenge scoring): galleries of `gallery_size` DISTINCT images, one caption per image per
    view, every view averaged. See `leaderboard_galleries` and `evaluate_leaderboard`.
  * leaderboard_from_ordered: the real test protocol, captions in id order cut into consecutive chunks of
    `gallery_size`; each caption is ranked against the images of its own chunk (used by submission scoring).

Inputs are numpy arrays or torch tensors, ranked in float32 on the prediction's device in chunks of queries, or a
`Queries` made a block at a time (`RowQueries`: any rows, a gallery's), never held whole ([25,000 x 1536], 0.15 GB).
Only the gallery is scaled: a query row's positive norm cannot change which items are strictly higher, so similarity
blocks are divided by the gallery's norms (no normalised copies). `evaluate` reads both protocols from one matmul
pass; `evaluate_leaderboard` alone ranks each gallery's captions against its own images only (S / G of the work).
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np
import torch

# Queries per similarity block (chunk x G float32: 13 MB at 128 x 25,000). At 1024 a challenge-size `train` peaked
# 0.1 GB higher for 4% less time, at 256 a 1-trial study 0.015-0.027 GB higher for 3-7% less validation time
# (benchmarks/memory_peak.py; glibc keeps larger freed blocks in its heap).
DEFAULT_CHUNK = 128
# Recall cut-offs and the NDCG depth reported for the challenge (MRR is the leaderboard metric).
RECALL_AT = (1, 5, 10, 50)
NDCG_DEPTH = 100
GALLERY_SIZE = 100  # the challenge's gallery size (test captions are scored in chunks of 100)
METRIC_KEYS = ("mrr", "r1", "r5", "r10", "r50", "ndcg100", "median_rank", "p75_rank")


class Queries:
    """Queries [n, dim] on `device` made block by block: `make(start, stop)` returns rows start..stop as float32
    [stop - start, dim] (e.g. a model's predictions of those captions). Indexing takes a slice of rows."""

    ndim = 2

    def __init__(self, n: int, dim: int, device: torch.device, make):
        self.shape, self.device, self._make = torch.Size((n, dim)), torch.device(device), make

    def __getitem__(self, rows: slice) -> torch.Tensor:
        return self._make(*rows.indices(self.shape[0])[:2]).float()  # (start, stop) of the slice


class RowQueries(Queries):
    """Queries made from any rows: `take(rows)` (int64 [b]) gives those rows [b, dim] (an ensemble's sums, made for
    the gallery being ranked: no [n, dim] array held); `np.asarray` of it makes every row."""

    def __init__(self, n: int, dim: int, take: Callable[[np.ndarray], np.ndarray | torch.Tensor]):
        super().__init__(n, dim, torch.device("cpu"), lambda start, stop: self.take(np.arange(start, stop)))
        self._take = take

    def take(self, rows: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(self._take(np.asarray(rows, np.int64))).float()

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return np.asarray(self[0:self.shape[0]].numpy(), dtype)


def _as_tensor(x, device=None) -> torch.Tensor:
    """float32 tensor on `device` (default: the tensor's own device, CPU for numpy); a Queries stays as it is."""
    if isinstance(x, Queries):
        return x
    # detach: evaluation never builds an autograd graph; ascontiguousarray: from_numpy rejects negative strides.
    t = x.detach() if isinstance(x, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(x))
    return t.to(device=device if device is not None else t.device, dtype=torch.float32)


def _as_index(x) -> np.ndarray:
    """int64 numpy vector from numpy / torch / list."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.ascontiguousarray(np.asarray(x).astype(np.int64, copy=False).reshape(-1))


def _usable(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row norms [N] and a bool [N] marking usable rows: a NaN or inf anywhere makes the norm non-finite."""
    norm = torch.linalg.vector_norm(x, dim=1)
    return norm, torch.isfinite(norm) & (norm > 0)


def gallery_norms(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gallery row norms [N] to divide similarities by, and their usable mask [N].

    An unusable row's norm is NaN: its similarities are NaN and compare False, so as a distractor it never outranks
    anything, and the rank functions give the worst rank to a query whose target is one.
    """
    norm, valid = _usable(x)
    return torch.where(valid, norm, torch.full_like(norm, float("nan"))), valid


def _normalise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """L2-normalised rows [N, D] (all-NaN where unusable, see `gallery_norms`) and their usable mask [N]."""
    norm, valid = gallery_norms(x)
    return x / norm[:, None], valid


def rank_against(scores: torch.Tensor, true: torch.Tensor, counted: torch.Tensor | None = None) -> torch.Tensor:
    """The rank rule above, in one place: 1 + how many of each row's scores [b, G] are strictly higher than its true
    item's score true [b, 1] (ties favour the true item), counting only the `counted` [b, G] columns when given."""
    higher = scores > true
    return 1 + (higher if counted is None else higher & counted).sum(dim=1)


def _block_ranks(q, g, g_norm, g_ok, target, chunk, galleries=None, query_gallery=None):
    """Ranks of target[i] [Q] for queries q [Q, D] (tensor or Queries) against gallery g [G, D] with its norms g_norm
    [G] (`gallery_norms`), in blocks of `chunk` queries (each block of a Queries is made, ranked and dropped).

    With galleries [B, S] (rows of g) and query_gallery [Q] (each query's gallery, which holds its target) it also
    returns the rank inside the query's S gallery columns, read from the same similarity block.
    Returns (global ranks [Q], leaderboard ranks [Q] or None).
    """
    n = q.shape[0]
    out = torch.empty(n, dtype=torch.int64, device=q.device)
    lb = None if galleries is None else torch.empty(n, dtype=torch.int64, device=q.device)
    for start in range(0, n, chunk):
        rows = slice(start, min(start + chunk, n))
        block = q[rows]                                               # [c, D]
        sims = (block @ g.T).div_(g_norm)                             # [c, G], cosine up to the query's norm
        true = sims.gather(1, target[rows, None])                     # [c, 1], same row as the comparison
        # A degenerate query or target (NaN true similarity compares False everywhere) gets the worst rank.
        bad = ~_usable(block)[1] | ~g_ok[target[rows]]
        out[rows] = torch.where(bad, g.shape[0], rank_against(sims, true))
        if lb is not None:
            cols = galleries[query_gallery[rows]]                     # [c, S] columns of each query's gallery
            lb[rows] = torch.where(bad, galleries.shape[1], rank_against(sims.gather(1, cols), true))
    return out, lb


def ranks(queries, gallery, target, chunk: int = DEFAULT_CHUNK) -> np.ndarray:
    """Rank [Q] (int64, 1 = best) of gallery row target[i] for query i under cosine similarity and the strict rule.

    queries [Q, D], gallery [G, D] (numpy or torch), target [Q] int indices into gallery.
    Work runs on the queries' device in blocks of `chunk` queries.
    """
    q = _as_tensor(queries)
    g = _as_tensor(gallery, q.device)
    tgt = _as_index(target)
    if q.ndim != 2 or g.ndim != 2 or q.shape[1] != g.shape[1]:
        raise ValueError(f"ranks: queries {tuple(q.shape)} and gallery {tuple(g.shape)} must be [Q, D] and [G, D]")
    if tgt.shape[0] != q.shape[0]:
        raise ValueError(f"ranks: {tgt.shape[0]} targets for {q.shape[0]} queries")
    if tgt.size and (tgt.min() < 0 or tgt.max() >= g.shape[0]):
        raise ValueError(f"ranks: target out of range [0, {g.shape[0]})")
    if chunk < 1:
        raise ValueError(f"ranks: chunk must be >= 1, got {chunk}")
    out, _ = _block_ranks(q, g, *gallery_norms(g), torch.from_numpy(tgt).to(q.device), chunk)
    return out.cpu().numpy()


def summarize(rank_values) -> dict[str, float]:
    """Metrics of a rank vector: MRR, recall@1/5/10/50, NDCG@100 (single relevant item), median and p75 rank."""
    r = np.asarray(rank_values, dtype=np.float64).reshape(-1)
    if r.size == 0:
        raise ValueError("summarize: no ranks to summarise")
    out = {"mrr": float(np.mean(1.0 / r))}
    for k in RECALL_AT:
        out[f"r{k}"] = float(np.mean(r <= k))
    # Binary relevance with one target: DCG = 1/log2(rank+1) and the ideal DCG is 1.
    out[f"ndcg{NDCG_DEPTH}"] = float(np.mean(np.where(r <= NDCG_DEPTH, 1.0 / np.log2(r + 1.0), 0.0)))
    out["median_rank"] = float(np.median(r))
    out["p75_rank"] = float(np.percentile(r, 75))
    return out


def _check_pairing(pred: torch.Tensor, image: torch.Tensor, cap2img: np.ndarray, fn: str) -> None:
    if pred.ndim != 2 or image.ndim != 2 or pred.shape[1] != image.shape[1]:
        raise ValueError(f"{fn}: pred {tuple(pred.shape)} and image {tuple(image.shape)} must be [Q, D] and [G, D]")
    if cap2img.shape[0] != pred.shape[0]:
        raise ValueError(f"{fn}: cap2img has {cap2img.shape[0]} entries for {pred.shape[0]} captions")
    if cap2img.size == 0:
        raise ValueError(f"{fn}: no captions to evaluate")
    if cap2img.min() < 0 or cap2img.max() >= image.shape[0]:
        raise ValueError(f"{fn}: cap2img out of range [0, {image.shape[0]})")


def evaluate_global(pred, image, cap2img, chunk: int = DEFAULT_CHUNK) -> dict[str, float]:
    """Global protocol: each caption's prediction pred[i] ranked against all images; its true image is cap2img[i]."""
    return summarize(ranks(pred, image, cap2img, chunk=chunk))


def leaderboard_galleries(cap2img, n_images: int, gallery_size: int = GALLERY_SIZE, seed: int = 0):
    """Galleries and queries of the leaderboard protocol (index bookkeeping only, numpy).

    Only images that have at least one caption take part. They are shuffled with `seed` and cut into galleries of
    `gallery_size`; when their number is not a multiple of gallery_size, the last gallery is topped up with distinct
    images drawn from earlier galleries, so every gallery holds min(gallery_size, n) distinct images and none repeats
    an image. Topped-up images are distractors only: a gallery's queries are its own images' captions.
    View v picks, for every image, its v-th caption (in caption order, cycling modulo the image's caption count);
    n_views = the largest caption count of an image.

    Returns (galleries int64 [B, S] image indices, owner bool [B, S] (True where the slot's image is a query of this
    gallery), views int64 [V, B, S] caption index per slot and view, -1 where the slot is not a query).
    """
    if gallery_size < 1:
        raise ValueError(f"leaderboard_galleries: gallery_size must be >= 1, got {gallery_size}")
    cap2img = _as_index(cap2img)
    counts = np.bincount(cap2img, minlength=n_images)                # captions per image
    order = np.argsort(cap2img, kind="stable")                        # caption indices grouped by image
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])             # start of each image's run in `order`
    imgs = np.flatnonzero(counts)
    imgs = imgs[np.random.default_rng(seed).permutation(imgs.size)]
    size = min(gallery_size, imgs.size)
    n_gal = -(-imgs.size // size)
    fill = n_gal * size - imgs.size
    # Top-up images come from the start of the shuffle: they sit in earlier galleries, so never in the last one.
    slots = np.concatenate([imgs, imgs[:fill]])
    galleries = slots.reshape(n_gal, size)
    owner = np.ones(n_gal * size, dtype=bool)
    owner[imgs.size:] = False
    owner = owner.reshape(n_gal, size)
    n_views = int(counts.max())
    v = np.arange(n_views)[:, None, None]                             # [V, 1, 1]
    caps = order[first[galleries][None] + v % counts[galleries][None]]  # [V, B, S]
    views = np.where(owner[None], caps, -1)
    return galleries, owner, views


def _checked_inputs(pred, image, cap2img, chunk: int, fn: str):
    """(pred, image, cap2img) as float32 tensors on the prediction's device and an int64 index, checked for `fn`."""
    p = _as_tensor(pred)
    img = _as_tensor(image, p.device)
    c2i = _as_index(cap2img)
    _check_pairing(p, img, c2i, fn)
    if chunk < 1:
        raise ValueError(f"{fn}: chunk must be >= 1, got {chunk}")
    return p, img, c2i


class CaptionGalleries(NamedTuple):
    """Where each caption is ranked in the leaderboard protocol: the gallery owning its image, gallery [Q], and that
    image's column in it, column [Q]; and the captions grouped by gallery, gallery b's at
    order[bounds[b]:bounds[b + 1]]."""
    gallery: np.ndarray
    column: np.ndarray
    order: np.ndarray
    bounds: np.ndarray


def caption_galleries(galleries: np.ndarray, owner: np.ndarray, cap2img: np.ndarray, n_images: int) \
        -> CaptionGalleries:
    """CaptionGalleries of `leaderboard_galleries`' (galleries, owner) for captions cap2img [Q] of n_images images.
    A caption's gallery is its image's, fixed across views: a caption is ranked once, the views only select."""
    gal_of = np.full(n_images, -1, dtype=np.int64)                    # owning gallery of each captioned image
    gal_of[galleries[owner]] = np.nonzero(owner)[0]
    col_of = np.full(n_images, -1, dtype=np.int64)                    # its column in that gallery
    col_of[galleries[owner]] = np.nonzero(owner)[1]
    gallery = gal_of[cap2img]
    order = np.argsort(gallery, kind="stable")
    return CaptionGalleries(gallery, col_of[cap2img], order,
                            np.searchsorted(gallery[order], np.arange(len(galleries) + 1)))


def _protocol_ranks(pred, image, cap2img, gallery_size, seed, chunk, fn):
    """Global ranks [Q] and leaderboard ranks [Q] of every caption (one pass), plus the galleries' views and owner."""
    p, img, c2i = _checked_inputs(pred, image, cap2img, chunk, fn)
    galleries, owner, views = leaderboard_galleries(c2i, img.shape[0], gallery_size, seed)
    where = caption_galleries(galleries, owner, c2i, img.shape[0])
    dev = p.device
    glob, lb = _block_ranks(p, img, *gallery_norms(img), torch.from_numpy(c2i).to(dev), chunk,
                            torch.from_numpy(galleries).to(dev), torch.from_numpy(where.gallery).to(dev))
    return glob.cpu().numpy(), lb.cpu().numpy(), views, owner


def average_views(lb_ranks: np.ndarray, views: np.ndarray, owner: np.ndarray) -> dict[str, float]:
    """Summaries of each view (one caption per captioned image) averaged over the views."""
    per_view = [summarize(lb_ranks[view[owner]]) for view in views]
    return {k: float(np.mean([m[k] for m in per_view])) for k in METRIC_KEYS}


def evaluate_leaderboard(pred, image, cap2img, gallery_size: int = GALLERY_SIZE, seed: int = 0,
                         chunk: int = DEFAULT_CHUNK) -> dict[str, float]:
    """Leaderboard protocol: galleries of `gallery_size` distinct images (see `leaderboard_galleries`), one caption
    per image per view; the metrics of every view are averaged (each view has one query per captioned image).

    Ranks gallery by gallery (`_leaderboard_ranks`); a `Queries` input, made in caption order, is ranked in the global
    pass's blocks instead (as much arithmetic as the global protocol). `evaluate` gives both protocols in one pass.
    """
    if isinstance(pred, Queries) and not isinstance(pred, RowQueries):  # made in caption order: ranked so
        _, lb, views, owner = _protocol_ranks(pred, image, cap2img, gallery_size, seed, chunk, "evaluate_leaderboard")
    else:
        lb, views, owner = _leaderboard_ranks(pred, image, cap2img, gallery_size, seed, chunk)
    return average_views(lb, views, owner)


def _leaderboard_ranks(pred, image, cap2img, gallery_size: int, seed: int, chunk: int):
    """Leaderboard ranks [Q] alone, gallery by gallery: a gallery's captions [n, D] against its S images only, the
    global protocol's [Q, G] similarities never made (at challenge size S / G = 1/50 of its arithmetic: the pick
    scored 61 ensembles of the val split in 133 s on 2 cores that way). The same galleries, views, rank rule,
    degenerate rows and true similarity gathered from its own row as `_block_ranks`. Returns (ranks, views, owner)."""
    p, img, c2i = _checked_inputs(pred, image, cap2img, chunk, "evaluate_leaderboard")
    galleries, owner, views = leaderboard_galleries(c2i, img.shape[0], gallery_size, seed)
    where = caption_galleries(galleries, owner, c2i, img.shape[0])
    g_norm, g_ok = gallery_norms(img)
    step = max(chunk, chunk * img.shape[0] // galleries.shape[1])     # a block holds what _block_ranks' does
    out = torch.empty(p.shape[0], dtype=torch.int64, device=p.device)
    for b, cols in enumerate(torch.from_numpy(galleries).to(p.device)):
        members = where.order[where.bounds[b]:where.bounds[b + 1]]
        gallery, norms = img.index_select(0, cols), g_norm[cols]      # [S, D], [S]
        for start in range(0, len(members), step):
            caps = members[start:start + step]
            rows = torch.from_numpy(caps).to(p.device)
            block = p.take(caps) if isinstance(p, RowQueries) else p.index_select(0, rows)  # [n, D]
            sims = (block @ gallery.T).div_(norms)                    # [n, S]
            true = sims.gather(1, torch.from_numpy(where.column[caps]).to(p.device)[:, None])  # [n, 1], same row
            bad = ~_usable(block)[1] | ~g_ok[torch.from_numpy(c2i[caps]).to(p.device)]
            out[rows] = torch.where(bad, galleries.shape[1], rank_against(sims, true))
    return out.cpu().numpy(), views, owner


def leaderboard_ranks(pred, image, cap2img, gallery_size: int = GALLERY_SIZE, seed: int = 0,
                      chunk: int = DEFAULT_CHUNK) -> tuple[np.ndarray, float]:
    """(each caption's leaderboard rank, int64 [Q]; the leaderboard MRR): evaluate_leaderboard's ranks, for comparing
    two answers caption by caption on the same galleries."""
    lb, views, owner = _leaderboard_ranks(pred, image, cap2img, gallery_size, seed, chunk)
    return lb, average_views(lb, views, owner)["mrr"]


def evaluate(pred, image, cap2img, gallery_size: int = GALLERY_SIZE, seed: int = 0,
             chunk: int = DEFAULT_CHUNK) -> dict[str, float]:
    """Per-epoch validation: leaderboard metrics under the plain keys ("mrr", "r1", ...) and the global protocol's
    under the same keys suffixed "_global" ("mrr_global", ...), both from one pass over the similarities."""
    return evaluate_with_ranks(pred, image, cap2img, gallery_size, seed, chunk)[0]


def evaluate_with_ranks(pred, image, cap2img, gallery_size: int = GALLERY_SIZE, seed: int = 0,
                        chunk: int = DEFAULT_CHUNK) -> tuple[dict[str, float], np.ndarray]:
    """`evaluate`'s metrics and the global ranks [Q] they summarise (the rank plot's), from the same one pass."""
    glob, lb, views, owner = _protocol_ranks(pred, image, cap2img, gallery_size, seed, chunk, "evaluate")
    out = average_views(lb, views, owner)
    out.update({f"{k}_global": v for k, v in summarize(glob).items()})
    return out, glob


def leaderboard_from_ordered(pred, image_of_each_caption, gallery_size: int = GALLERY_SIZE) -> dict[str, float]:
    """The real test protocol: captions in id order cut into consecutive chunks of `gallery_size` (the last chunk may
    be shorter); caption i is ranked against the true images of the captions of its chunk, its own being the target.

    pred [N, D] predicted image embeddings, image_of_each_caption [N, D] the true image embedding of each caption.
    An image that appears twice in a chunk ties with itself, which the strict rank rule does not penalise.
    """
    p = _as_tensor(pred)
    img = _as_tensor(image_of_each_caption, p.device)
    if p.shape != img.shape or p.ndim != 2:
        raise ValueError(f"leaderboard_from_ordered: pred {tuple(p.shape)} and images {tuple(img.shape)} differ")
    if p.shape[0] == 0 or gallery_size < 1:
        raise ValueError(f"leaderboard_from_ordered: {p.shape[0]} captions, gallery_size {gallery_size}")
    g_norm, g_ok = gallery_norms(img)
    out = torch.empty(p.shape[0], dtype=torch.int64, device=p.device)
    for start in range(0, p.shape[0], gallery_size):                  # one small matmul per chunk of captions
        rows = slice(start, min(start + gallery_size, p.shape[0]))
        slot = torch.arange(rows.stop - start, device=p.device)        # caption j's true image is row j of its chunk
        out[rows] = _block_ranks(p[rows], img[rows], g_norm[rows], g_ok[rows], slot, DEFAULT_CHUNK)[0]
    return summarize(out.cpu().numpy())


__all__ = ["Queries", "RowQueries", "ranks", "summarize", "evaluate_global", "evaluate_leaderboard",
           "leaderboard_ranks", "evaluate", "leaderboard_galleries", "caption_galleries", "CaptionGalleries",
           "leaderboard_from_ordered", "METRIC_KEYS", "GALLERY_SIZE", "DEFAULT_CHUNK", "average_views",
           "gallery_norms", "rank_against"]


def label_retrieval(emb, labels, k: int = 10, chunk: int = DEFAULT_CHUNK) -> dict[str, float]:
    """Item-to-item retrieval judged by labels (the multilabel task): each item queries all the others.

    emb [N, D], labels [N, L] bool. An item is relevant to a query when they share at least one label; the query
    itself is excluded. `mrr`: mean over queries of 1 / rank of the first relevant item, with the same strict rule
    (rank = 1 + number of irrelevant items scoring strictly higher than the best relevant one). `recall@k`: fraction of
    queries with a relevant item in the top k. Queries with no relevant item anywhere are left out.
    """
    e = _as_tensor(emb)
    lab = torch.as_tensor(np.asarray(labels) if not torch.is_tensor(labels) else labels, device=e.device).bool()
    en, _ = _normalise(e)
    first = []
    for start in range(0, len(en), chunk):
        sim = en[start : start + chunk] @ en.T  # [c, N]
        rows = torch.arange(start, min(start + chunk, len(en)), device=e.device)
        relevant = (lab[rows].float() @ lab.T.float()) > 0  # [c, N] shares >= 1 label
        relevant[torch.arange(len(rows)), rows] = False
        sim[torch.arange(len(rows)), rows] = -torch.inf  # the query never retrieves itself
        best_rel = torch.where(relevant, sim, torch.full_like(sim, -torch.inf)).max(1).values
        higher = ((sim > best_rel[:, None]) & ~relevant).sum(1)
        first.append(torch.where(relevant.any(1), higher + 1, torch.zeros_like(higher)))
    rank = torch.cat(first).cpu().numpy() if first else np.zeros(0, dtype=np.int64)
    rank = rank[rank > 0]
    if rank.size == 0:
        return {"mrr": 0.0, f"recall@{k}": 0.0, "queries": 0.0}
    return {"mrr": float(np.mean(1.0 / rank)), f"recall@{k}": float(np.mean(rank <= k)), "queries": float(rank.size)}
