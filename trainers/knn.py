"""The kernel model (model.kind = "knn"): a caption's image embedding as the softmax-weighted mean of the images of
its nearest training captions (Nadaraya-Watson regression). Fitted when built, nothing trained.

Why a model with no weights: with a few thousand training images a learned map is data-starved, and the images
of similar training captions carry what it cannot learn. Its errors differ from a trained model's, so it pays as an
ensemble member (README, "Picking an ensemble": measured on the demo holdouts) even where it is weaker alone.
"""
from __future__ import annotations

import math

import torch

from trainers.config import Config
from trainers import metrics
from trainers.metrics import GALLERY_SIZE
from trainers.model_context import FitSet, ModelContext
from trainers.translator import Translator, l2_normalize

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


class KernelTranslator(Translator):
    """raw = sum over the k most similar training captions of softmax(cos / tau) x unit image of that caption.

    Keys are the training captions, centred by their own mean and L2-normalised ([N, Dt]); values the unit training
    images ([Ni, Di]) with each key's image index ([N]). With model.knn_tau = 0, tau is chosen when built by
    leave-one-image-out MRR on the training captions (choose_tau), which imitates retrieval of unseen images."""

    def __init__(self, cfg: Config, ctx: ModelContext):
        super().__init__(cfg.model.out_norm)
        self.k = cfg.model.knn_k
        fit = ctx.take_fit_set() if ctx.has_fit else None
        if fit is None:  # weights from a checkpoint: load_state_dict gives the buffers their sizes
            mean, keys = torch.zeros(ctx.dim_in), torch.zeros(0, ctx.dim_in)
            img, values, tau = torch.zeros(0, dtype=torch.long), torch.zeros(0, ctx.dim_out), 1.0
        else:
            mean, keys = _unit_keys(fit.x, fit.owned)
            img, values = fit.img.long(), l2_normalize(fit.images.float())
            del fit  # an owned fit set's captions are the keys now; its raw images are freed here
            tau = cfg.model.knn_tau or choose_tau(FitSet(keys, img, values), self.k, cfg.train.seed)
        for name, value in zip(_BUFFERS, (mean, keys, img, values, torch.tensor(float(tau)))):
            self.register_buffer(name, value)

    def translate(self, x: torch.Tensor) -> torch.Tensor:
        q = l2_normalize(x.float() - self.key_mean)  # [B, Dt]
        out = [self.values.new_zeros(0, self.values.shape[1])]
        for block in q.split(BLOCK):
            sim, idx = nearest(block, self.keys, self.key_image, self.k)
            w = torch.softmax(sim / self.tau, dim=1)  # [b, k]
            out.append(torch.einsum("bk,bkd->bd", w, self.values[self.key_image[idx]]))  # [b, Di]
        return torch.cat(out)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        for name in _BUFFERS:  # sized by the training set, which a checkpoint-built model does not know
            if prefix + name in state_dict:
                setattr(self, name, torch.empty_like(state_dict[prefix + name], device=getattr(self, name).device))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def choose_tau(fit: FitSet, k: int, seed: int) -> float:
    """The TAU_GRID temperature with the best leave-one-image-out MRR: up to CHOICE_QUERIES training captions, each
    translated from the other images' captions only, ranked against a gallery of GALLERY_SIZE training images as on
    the leaderboard (its own image and random others), under trainers.metrics' rank rule. With one image there is
    nothing to leave out: tau = the grid's middle."""
    keys, img, values = fit.x, fit.img, fit.images
    n_img = values.shape[0]
    if n_img < 2:
        return TAU_GRID[len(TAU_GRID) // 2]
    gen = torch.Generator().manual_seed(seed)
    queries = torch.randperm(keys.shape[0], generator=gen)[:CHOICE_QUERIES].to(keys.device)
    gallery = torch.randperm(n_img, generator=gen)[:GALLERY_SIZE].to(keys.device)  # [G]
    rr = torch.zeros(len(TAU_GRID), device=keys.device)
    for q in queries.split(BLOCK):
        own = img[q]  # [b]
        sim, idx = nearest(keys[q], keys, img, k, exclude=own)
        neighbours = values[img[idx]]  # [b, k', Di]
        own_score = torch.einsum("bkd,bd->bk", neighbours, values[own])  # [b, k'] each neighbour's image vs own
        gal_score = torch.einsum("bkd,gd->bkg", neighbours, values[gallery])  # [b, k', G]
        rivals = gallery[None, :] != own[:, None]  # [b, G]: the gallery without the query's own image
        for t, tau in enumerate(TAU_GRID):
            w = torch.softmax(sim / tau, dim=1)  # [b, k']
            mine = (w * own_score).sum(1)  # [b]
            others = torch.einsum("bk,bkg->bg", w, gal_score)  # [b, G]
            rr[t] += (1.0 / metrics.rank_against(others, mine[:, None], rivals).float()).sum()
    return TAU_GRID[int(torch.argmax(rr))]


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
    if exclude is not None:
        sim = sim.masked_fill(key_image[None, :] == exclude[:, None], -math.inf)
    return sim.topk(min(k, sim.shape[1]), dim=1)
