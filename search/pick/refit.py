"""The training jobs of `latentsweep pick`: out-of-fold models and refits on every labelled image, each cached on disk
and planned to fit a time budget (search.pick.plan).

A job replays one trial's configuration with `data.split = "all"` (no validation) on a set of images for the number
of epochs the trial found best (`train.stop_after = best epoch + 1`), keeping the trial's schedule horizon
(`train.epochs`), so the learning-rate curve up to that epoch is the one that produced the trial's best value. An epoch
is one pass over the data, so a larger training set gets proportionally more steps at the same epoch count.
"""
from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from trainers.config import Config, dump_toml, with_values
from trainers.data import TrainSet
from trainers.splits import captions_of, kfold_by_image
from trainers.io import atomic_write
from trainers.loop import train

DONE_FILE = "done.json"  # written when a job finished; a job with the same config and data reuses its model


def note(message: str) -> None:
    print(f"latentsweep: {message}", file=sys.stderr)


def subset(data: TrainSet, images: np.ndarray) -> TrainSet:
    """The TrainSet restricted to `images` (sorted int64 indices) and their captions; a fingerprint of its own."""
    images = np.sort(np.asarray(images, np.int64))
    caps = captions_of(data.cap2img, images)
    local = np.full(len(data.image), -1, np.int64)
    local[images] = np.arange(len(images))
    labels = None if data.image_labels is None else data.image_labels[images]
    return replace(data, fingerprint=subset_fingerprint(data, images), caption_ids=data.caption_ids[caps],
                   caption_text=data.caption_text[caps], text=data.text[caps], image=data.image[images],
                   cap2img=local[data.cap2img[caps]], image_names=data.image_names[images], image_labels=labels)


def subset_fingerprint(data: TrainSet, images: np.ndarray | None) -> str:
    """The data's fingerprint, extended with a digest of the image subset (None = every image)."""
    if images is None:
        return data.fingerprint
    digest = hashlib.md5(np.sort(np.asarray(images, np.int64)).tobytes()).hexdigest()[:12]
    return f"{data.fingerprint}/images-{digest}"


def fold_assignment(image_names: np.ndarray, n_folds: int) -> np.ndarray:
    """int64 [Ni]: each image's fold, exactly as `kfold_by_image` deals them."""
    fold_of = np.empty(len(image_names), np.int64)
    for f in range(n_folds):
        fold_of[kfold_by_image(image_names, n_folds, f)[1]] = f
    return fold_of


@dataclass(frozen=True)
class Job:
    name: str  # "trial-3/fold-1-of-5" or "trial-3/seed-1"
    member: str  # the candidate it belongs to ("trial-3")
    cfg: Config
    images: np.ndarray | None  # training images; None = every labelled image
    run_dir: Path
    cost: float  # estimated seconds; 0 when a finished identical job can be reused


def replay_config(cfg: Config, best_epoch: int, seed: int | None = None) -> Config:
    """The trial's config trained without validation up to its best epoch (0-based), optionally with another seed."""
    values = {"data.split": "all", "train.stop_after": best_epoch + 1}
    if seed is not None:
        values["train.seed"] = seed
    return with_values(cfg, values)


def done_stamp(cfg: Config, fingerprint: str) -> dict[str, str]:
    return {"config_sha256": hashlib.sha256(dump_toml(cfg).encode()).hexdigest(), "data_fingerprint": fingerprint}


def is_done(run_dir: Path, stamp: dict) -> bool:
    done = run_dir / DONE_FILE
    return done.is_file() and (run_dir / "best.pt").is_file() and json.loads(done.read_text()) == stamp


def make_job(name: str, member: str, cfg: Config, data: TrainSet, images, run_dir: Path,
             seconds_per_caption_epoch: float) -> Job:
    fingerprint = subset_fingerprint(data, images)
    n_caps = len(data.cap2img) if images is None else len(captions_of(data.cap2img, images))
    cost = 0.0 if is_done(run_dir, done_stamp(cfg, fingerprint)) else (
        seconds_per_caption_epoch * n_caps * (cfg.train.stop_after or cfg.train.epochs))
    return Job(name, member, cfg, images, run_dir, cost)


def describe(job: Job, seconds: float | None) -> str:
    """What a finished job did, for the pick's progress line."""
    if seconds is None:
        return f"reused {job.run_dir}"
    return (f"trained {job.cfg.train.stop_after} epochs in {seconds:.0f} s (estimated {job.cost:.0f} s)")


def run_job(job: Job, data: TrainSet, progress: bool) -> tuple[Path, float | None]:
    """Train (or reuse) the job: (its checkpoint, seconds spent training; None when reused). The done stamp is
    written only after training finished."""
    part = data if job.images is None else subset(data, job.images)
    stamp = done_stamp(job.cfg, part.fingerprint)
    ckpt = job.run_dir / "best.pt"
    if is_done(job.run_dir, stamp):
        return ckpt, None
    job.run_dir.mkdir(parents=True, exist_ok=True)
    (job.run_dir / DONE_FILE).unlink(missing_ok=True)
    with atomic_write(job.run_dir / "config.toml") as fh:
        fh.write(dump_toml(job.cfg))
    start = time.monotonic()
    train(job.cfg, part, out_dir=job.run_dir, progress=progress)
    with atomic_write(job.run_dir / DONE_FILE) as fh:
        fh.write(json.dumps(stamp))
    return ckpt, time.monotonic() - start


__all__ = ["Job", "describe", "done_stamp", "fold_assignment", "is_done", "make_job", "note", "replay_config", "run_job",
           "subset"]
