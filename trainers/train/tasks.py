"""Tasks: how a TrainSet becomes device tensors, batches and per-epoch validation metrics (translate, multilabel)."""
from __future__ import annotations

import contextlib
import time
from typing import Iterator

import numpy as np
import torch
import torch.nn.functional as F

from latentsweep.trainers.eval import metrics
from latentsweep.trainers.config.tree import Config
from latentsweep.trainers.data.sets import TrainSet
from latentsweep.trainers.core.errors import ConfigError, DataError
from latentsweep.trainers.losses import EpochContext, batch_keys
from latentsweep.trainers.losses.multilabel import draw_fixed_positives
from latentsweep.trainers.models.model_context import FitRows, FitSet, ModelContext
from latentsweep.trainers.config.registry import Registry
from latentsweep.trainers.core.pages import take
from latentsweep.trainers.data.rows import Rows
from latentsweep.trainers.data.splits import captions_and_local_images, captions_of, kfold_by_image, split_by_hash

TASKS: Registry = Registry("task")

# Rows per forward pass at evaluation time: bounds activation memory (4096 x 2048 floats = 32 MB per layer).
EVAL_CHUNK = 4096
# Val rows a finished run predicts again to time what the pick pays per candidate (predict_again_s): one EVAL_CHUNK
# forward, milliseconds for an MLP; the knn model reads them from its memo as the pick does.
AGAIN_ROWS = EVAL_CHUNK


def split_images(cfg: Config, data: TrainSet) -> tuple[np.ndarray, np.ndarray]:
    """(train image indices, val image indices): always by image, never by caption. The split functions check
    their arguments and refuse an empty side (latentsweep.trainers.data.splits)."""
    d = cfg.data
    if d.split == "all":
        return np.arange(len(data.image_names)), np.zeros(0, np.int64)
    if d.split == "kfold":
        return kfold_by_image(data.image_names, d.n_folds, d.fold, seed=0)
    return split_by_hash(data.image_names, d.val_ratio, salt=d.salt)


def check_split(cfg: Config, data: TrainSet) -> None:
    """Fail before training when `data` cannot be split for cfg's task, so a study learns it before its first
    trial instead of failing every trial."""
    TASKS.get(cfg.data.task).check_data(cfg, data)


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module):
    """The model in eval mode without autograd for the block; its previous mode is restored after."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield model
    finally:
        model.train(was_training)


def queries(model: torch.nn.Module, x: torch.Tensor | Rows, dim_out: int) -> metrics.Queries:
    """The model's eval-mode predictions of x [N, D_in] as metrics.Queries [N, dim_out], made one block at a time
    while the metrics rank them: validation never holds every prediction."""
    def block(start: int, stop: int) -> torch.Tensor:
        with eval_mode(model):
            return model(x[start:stop])["pred"]

    return metrics.Queries(len(x), dim_out, x.device, block)


def predict(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Eval-mode outputs ("pred") of `model` for x [N, D_in], in chunks; restores the previous mode."""
    with eval_mode(model):
        out = None  # [N, D_out] float32, filled chunk by chunk: a list of chunks and their cat held the output twice
        for i in range(0, len(x), EVAL_CHUNK):
            chunk = model(x[i : i + EVAL_CHUNK])["pred"]
            if out is None:
                out = torch.empty((len(x), chunk.shape[1]), dtype=torch.float32, device=chunk.device)
            out[i : i + len(chunk)] = chunk
        return out if out is not None else model(x[:0])["pred"].float()


class Task:
    """Base: holds the split's tensors on the device and the batch generator."""

    dim_in: int
    dim_out: int
    metric_key = "val/mrr"

    @staticmethod
    def val_keys(cfg: Config) -> tuple[str, ...]:
        """The validation metrics evaluate() logs each epoch (what a study may use as its objective)."""
        raise NotImplementedError

    @staticmethod
    def check_data(cfg: Config, data: TrainSet) -> None:
        """Raise a one-line error when the split of `data` cannot train this task (the split itself checks sizes)."""
        split_images(cfg, data)

    def model_context(self) -> ModelContext:
        raise NotImplementedError

    def steps_per_epoch(self) -> int:
        raise NotImplementedError

    def batches(self, generator: torch.Generator) -> Iterator[dict]:
        raise NotImplementedError

    def epoch_context(self, model: torch.nn.Module) -> EpochContext:
        """What the losses may use at the start of an epoch: the model's embeddings of every training item, on demand
        (a loss that mines global negatives calls it; the others cost nothing)."""
        return EpochContext(embed_train=lambda: predict(model, self.x))

    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        raise NotImplementedError

    def val_batches(self) -> Iterator[dict]:
        """Validation batches (fixed order, train.batch_size rows) for the validation loss (train.monitor)."""
        raise NotImplementedError

    def predict_again_s(self, model: torch.nn.Module) -> float:
        """Seconds `model` takes to predict the val inputs again, as the pick does with a candidate (its checkpoint
        loaded aside): the first AGAIN_ROWS timed, scaled to all. At challenge size a knn trial's validation took
        122 s on 2 cores and predicting again reads its memo; an MLP's is a forward of 25,000 rows."""
        x = getattr(self, "val_x", None)  # a plugin's task may hold none
        if x is None or len(x) == 0:
            return 0.0
        rows = min(AGAIN_ROWS, len(x))
        started = time.perf_counter()
        with eval_mode(model):
            model(x[:rows])["pred"].sum().item()  # .item(): the work done on a GPU too, not only queued
        return (time.perf_counter() - started) * len(x) / rows

    # Ranks [Nval] of the last evaluate() for the rank-distribution plot (read by the loop for its best epoch, so
    # that plot costs no second validation pass); None where the task has no single true item or nothing is held out.
    last_ranks: np.ndarray | None = None


@TASKS.register("translate")
class TranslateTask(Task):
    """Caption embedding -> image embedding; validation ranks val captions against val images."""

    @staticmethod
    def val_keys(cfg: Config) -> tuple[str, ...]:
        return tuple(f"val/{k}" for k in metrics.METRIC_KEYS)

    @staticmethod
    def check_data(cfg: Config, data: TrainSet) -> None:
        """Both sides of the split need captions (images may have none): no training pairs or no val queries."""
        for side, img in zip(("training", "validation"), split_images(cfg, data)):
            if len(captions_of(data.cap2img, img)) == 0:
                raise ConfigError(f"{data.path}: the {cfg.data.split} split leaves the {side} images without "
                                  f"any caption; change data.val_ratio or data.salt, or use more images")

    def __init__(self, cfg: Config, data: TrainSet, device: torch.device):
        self.cfg, self.device = cfg, device
        train_img, val_img = split_images(cfg, data)
        # The training captions stay where they are: all captions [Nc, Dt] (on the CPU the loaded array itself, no
        # copy) and the training ones' rows [N]; a batch gathers its rows. A copy was 0.46 GB at challenge size.
        text = torch.as_tensor(data.text, device=device)
        self.x, self.img = self._caption_rows(text, data.cap2img, train_img)  # [N, Dt] rows, [N] local train image
        # Raw images likewise ([Ni, Di] rows of the loaded [Ni_all, Di]).
        self.images = Rows(torch.as_tensor(data.image, device=device), torch.as_tensor(train_img, device=device))
        # The exact all-images loss reads every normalised training image each batch, so only then are they held
        # ([Ni, Di], 0.12 GB at challenge size); otherwise each batch normalises its own rows (the same values:
        # F.normalize works row by row).
        self.bank = "bank" in batch_keys(cfg)
        self.images_n = F.normalize(self.images.materialize(), dim=1) if self.bank else None
        # Val captions as rows of the loaded array too (a copy was 0.1 GB at challenge size).
        self.val_x, self.val_img = self._caption_rows(text, data.cap2img, val_img)  # [Nv, Dt] rows, [Nv]
        self.val_images = torch.as_tensor(take(data.image, val_img), device=device)
        self.dim_in, self.dim_out = data.text.shape[1], data.image.shape[1]
        self.text_mean = (self.x.column_stat(lambda x: x.mean(0)) if cfg.data.center_text
                          else torch.zeros(self.dim_in, device=device))
        order = torch.argsort(self.img, stable=True)  # CSR of captions by image, for image sampling
        self.by_image = order
        self.offsets = torch.cat([torch.zeros(1, dtype=torch.long, device=device),
                                  torch.bincount(self.img, minlength=len(self.images)).cumsum(0)])

    def _caption_rows(self, text: torch.Tensor, cap2img: np.ndarray, images: np.ndarray) -> tuple[Rows, torch.Tensor]:
        """(every caption of `images` as rows of `text` [N, Dt], each caption's image as an index into `images`
        [N])."""
        caps, local = captions_and_local_images(cap2img, images)
        return Rows(text, torch.as_tensor(caps, device=self.device)), torch.as_tensor(local, device=self.device)

    def model_context(self) -> ModelContext:
        return ModelContext(self.dim_in, self.dim_out, fit=self._fit_set, rows=self._fit_rows, device=self.device)

    def _fit_rows(self) -> FitRows:
        """The same split as rows of the loaded arrays (the kernel model's keys and values): nothing copied."""
        return FitRows(self.x, self.text_mean, self.img, self.images)

    def _fit_set(self) -> FitSet:
        """Centred training captions [N, Dt], each one's image index [N] and the raw training images [Ni, Di]: built
        only for the models that read them (geometry, relative, knn), 0.5 GB at challenge size."""
        return FitSet(self.x.materialize().sub_(self.text_mean), self.img, self.images.materialize(), owned=True)

    def epoch_context(self, model: torch.nn.Module) -> EpochContext:
        return EpochContext(embed_train=lambda: predict(model, self.x), n_targets=len(self.images))

    def steps_per_epoch(self) -> int:
        return max(1, len(self.x) // self.cfg.train.batch_size)  # both samplers visit every caption once

    def batches(self, generator: torch.Generator) -> Iterator[dict]:
        rows = self._caption_order(generator) if self.cfg.train.sampler == "caption" else self._image_order(generator)
        b = self.cfg.train.batch_size
        # Drop the ragged tail: a 1-row batch has no negatives; every full batch is seen next epoch anyway.
        for start in range(0, max(1, len(rows) - b + 1), b):
            idx = rows[start : start + b]
            img = self.img[idx]
            # image_idx: each caption's training image, which augmentation leaves alone (img may be remapped)
            y = self.images[img]  # [B, Di]
            y_n = F.normalize(y, dim=1) if self.images_n is None else self.images_n[img]
            batch = {"x": self.x[idx], "y": y, "y_n": y_n, "img": img, "image_idx": img}
            yield batch | ({"bank": self._bank(self.images), "bank_idx": img} if self.bank else {})

    def _bank(self, images: torch.Tensor) -> torch.Tensor:
        """The all-images bank [Ni, Di] at the losses' target scale (loss.targets): unit, or raw as the data."""
        if self.cfg.loss.targets == "raw":
            return images
        return self.images_n if images is self.images else F.normalize(images, dim=1)

    def _caption_order(self, generator: torch.Generator) -> torch.Tensor:
        return torch.randperm(len(self.x), generator=generator).to(self.device)

    def _image_order(self, generator: torch.Generator) -> torch.Tensor:
        """Captions grouped by image (all captions of an image together), images in random order."""
        perm = torch.randperm(len(self.images), generator=generator).to(self.device)
        counts = (self.offsets[1:] - self.offsets[:-1])[perm]
        starts = self.offsets[:-1][perm]
        # counts sum to the training captions; giving repeat_interleave that size spares it a host sync per epoch
        n = len(self.x)
        within = torch.arange(n, device=self.device) - torch.repeat_interleave(counts.cumsum(0) - counts, counts,
                                                                                output_size=n)
        return self.by_image[torch.repeat_interleave(starts, counts, output_size=n) + within]

    def val_batches(self) -> Iterator[dict]:
        b = self.cfg.train.batch_size
        bank = self._bank(self.val_images) if self.bank else None  # the val images are the val loss's bank
        for start in range(0, len(self.val_x), b):
            img = self.val_img[start : start + b]
            y = self.val_images[img]
            batch = {"x": self.val_x[start : start + b], "y": y, "y_n": F.normalize(y, dim=1), "img": img}
            yield batch | ({"bank": bank, "bank_idx": img} if self.bank else {})

    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        if len(self.val_x) == 0:  # data.split = "all": nothing held out, the loop keeps the last epoch
            return {}
        e = self.cfg.eval
        scores, self.last_ranks = metrics.evaluate_with_ranks(queries(model, self.val_x, self.dim_out),
                                                              self.val_images, self.val_img,
                                                              gallery_size=e.gallery_size, seed=e.seed)
        return {f"val/{k}": float(v) for k, v in scores.items()}


@TASKS.register("multilabel")
class MultiLabelTask(Task):
    """Image -> embedding where images sharing labels are close; validation is label retrieval among val images."""

    @staticmethod
    def val_keys(cfg: Config) -> tuple[str, ...]:
        return ("val/mrr", f"val/recall@{cfg.eval.recall_k}", "val/queries")  # metrics.label_retrieval's keys

    def __init__(self, cfg: Config, data: TrainSet, device: torch.device):
        if data.image_labels is None:
            raise DataError(f"{data.path}: data.task='multilabel' needs per-image labels (key images/labels)")
        self.cfg, self.device = cfg, device
        train_img, val_img = split_images(cfg, data)
        self.x = torch.as_tensor(take(data.image, train_img), device=device)
        self.labels = torch.as_tensor(data.image_labels[train_img], device=device)
        self.val_x = torch.as_tensor(take(data.image, val_img), device=device)
        self.val_labels = torch.as_tensor(data.image_labels[val_img], device=device)
        self.dim_in = data.image.shape[1]
        self.dim_out = cfg.model.out_dim or self.dim_in
        self.text_mean = torch.zeros(self.dim_in, device=device)
        if len(self.x) < 2 or len(self.val_x) < 2:
            raise DataError(f"{data.path}: split leaves fewer than 2 train or val images")
        needs = batch_keys(cfg)  # what the active losses read besides x and labels
        # step_hard: neg_x is the hardest non-sharing item under the live model (the seed mines so every step)
        self.hard_negs = "neg_x" in needs and cfg.loss.multilabel_triplet.negatives == "step_hard"
        self.random_negs = "neg_x" in needs and not self.hard_negs
        self.live_model: torch.nn.Module | None = None  # set by epoch_context, read by step_hard mining
        self.fixed_pos = None  # [N] the seed's positive per train item, drawn once (-1: none)
        if "pos_x" in needs:
            gen = torch.Generator().manual_seed(cfg.train.seed)
            self.fixed_pos = draw_fixed_positives(self.labels, gen).to(device)

    def model_context(self) -> ModelContext:
        # Closed-form fits regress each item onto itself when dims agree (geometry keeps the space), else no fit.
        fit = self.dim_out == self.dim_in
        return ModelContext(self.dim_in, self.dim_out, fit_x=self.x if fit else None, fit_y=self.x if fit else None)

    def steps_per_epoch(self) -> int:
        return max(1, len(self.x) // self.cfg.train.batch_size)

    def batches(self, generator: torch.Generator) -> Iterator[dict]:
        perm = torch.randperm(len(self.x), generator=generator).to(self.device)
        b = min(self.cfg.train.batch_size, len(self.x))
        steps = len(perm) // b  # full batches; the ragged tail is dropped
        # The random negatives' candidates of the whole epoch in one draw and one copy to the device: CPU randint
        # draws element by element, so these are the numbers a draw per batch gave, without a host tensor made and
        # copied to the device every step (issue 33).
        cand = self._candidates(steps * b, generator) if self.random_negs else None  # [steps * B, tries]
        for start in range(0, steps * b, b):
            idx = perm[start : start + b]
            batch = {"x": self.x[idx], "labels": self.labels[idx], "img": idx}
            if self.random_negs:
                batch["neg_x"] = self.x[self._random_negatives(idx, cand[start : start + b])]
            if self.hard_negs:
                batch["neg_x"] = self.x[self._hardest_negatives(idx)]
            if self.fixed_pos is not None:
                pos = self.fixed_pos[idx]
                batch["pos_x"], batch["has_pos"] = self.x[pos.clamp(min=0)], pos >= 0
            yield batch

    def _candidates(self, n: int, generator: torch.Generator, tries: int = 16) -> torch.Tensor:
        """[n, tries] random training items on the device: `tries` negative candidates for each of n anchors."""
        return torch.randint(len(self.x), (n, tries), generator=generator).to(self.device)

    def _random_negatives(self, idx: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
        """For each anchor idx [B], a random training item sharing no label: the first of its candidates cand
        [B, tries] that qualifies."""
        shares = (self.labels[idx, None, :] & self.labels[cand]).any(-1)  # [B, tries]
        first_ok = torch.argmax((~shares).int(), dim=1)  # falls back to candidate 0 when none qualifies
        return cand[torch.arange(len(idx), device=self.device), first_ok]

    @torch.no_grad()
    def _hardest_negatives(self, idx: torch.Tensor) -> torch.Tensor:
        """[B] for each anchor the training item sharing no label with it whose embedding by the live model (eval
        mode, as now) is the most similar: every training item embedded again at each step, as the seed does."""
        emb = predict(self.live_model, self.x)  # [N, D]
        shares = (self.labels[idx].float() @ self.labels.float().T) > 0  # [B, N]; the anchor shares with itself
        return (emb[idx] @ emb.T).masked_fill(shares, -torch.inf).argmax(dim=1)

    def epoch_context(self, model: torch.nn.Module) -> EpochContext:
        self.live_model = model  # the batches of this epoch mine step_hard negatives with it
        return EpochContext(embed_train=lambda: predict(model, self.x), train_labels=self.labels)

    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        emb = predict(model, self.val_x)
        scores = metrics.label_retrieval(emb, self.val_labels, k=self.cfg.eval.recall_k)
        return {f"val/{k}": float(v) for k, v in scores.items()}
