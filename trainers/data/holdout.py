"""A local leaderboard: an image-disjoint holdout of a labelled train file, written in the challenge format
(train.npz, test.clean.npz, answers.npz) so that `latentsweep submission score` scores a submission exactly as the
leaderboard does (consecutive chunks of GALLERY_SIZE test captions in id order, each ranked against its chunk's
images)."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from latentsweep.trainers.data.sets import TrainSet
from latentsweep.trainers.data.writer import write_answers_npz, write_test_npz, write_train_npz
from latentsweep.trainers.core.errors import ConfigError, DataError
from latentsweep.trainers.eval.metrics import GALLERY_SIZE
from latentsweep.trainers.data.splits import captions_and_local_images

HOLDOUT_FILES = ("train.npz", "test.clean.npz", "answers.npz")  # what write_holdout writes, in its output directory
MIN_IMAGES = 2  # each side needs two images: one to train on beside another, one gallery to rank against


@dataclass(frozen=True)
class Holdout:
    train_images: int
    train_captions: int
    test_images: int
    test_captions: int  # every caption of every held-out image
    galleries: int  # chunks of GALLERY_SIZE captions (the last may be shorter)
    files: tuple[Path, Path, Path]  # train.npz, test.clean.npz, answers.npz


def held_out_images(names: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """Sorted indices of the held-out images: the round(fraction * Ni) with the smallest MD5(seed:name), so a
    holdout depends only on the names and the seed (not on the file's order)."""
    if not (isinstance(fraction, float) and 0.0 < fraction < 1.0):
        raise ConfigError(f"--fraction must be a number strictly between 0 and 1, got {fraction}")
    n = int(round(fraction * len(names)))
    if n < MIN_IMAGES or len(names) - n < MIN_IMAGES:
        raise DataError(f"--fraction {fraction} of {len(names)} images holds out {n}: both sides need at least "
                        f"{MIN_IMAGES} images")
    keys = [hashlib.md5(f"holdout{seed}:{name}".encode()).hexdigest() for name in names]
    return np.sort(np.argsort(keys, kind="stable")[:n].astype(np.int64))


def gallery_order(cap2img: np.ndarray, seed: int) -> np.ndarray:
    """Every caption (indices into cap2img), ordered so that each consecutive chunk of GALLERY_SIZE holds distinct
    images: each chunk takes one caption of each of the images with the most captions left (ties in a seeded random
    order), so the images run out together and only the last chunk may be short. Within a chunk the order is
    shuffled, so ids carry no image order."""
    rng = np.random.default_rng(seed)
    left: dict[int, list[int]] = {}
    for cap in rng.permutation(len(cap2img)):
        left.setdefault(int(cap2img[cap]), []).append(int(cap))
    tiebreak = {img: r for img, r in zip(left, rng.permutation(len(left)))}
    order: list[int] = []
    while left:
        chosen = sorted(left, key=lambda img: (-len(left[img]), tiebreak[img]))[:GALLERY_SIZE]
        chunk = [left[img].pop() for img in chosen]
        order += [chunk[i] for i in rng.permutation(len(chunk))]
        left = {img: caps for img, caps in left.items() if caps}
    return np.asarray(order, np.int64)


def write_holdout(data: TrainSet, fraction: float, seed: int, out: Path) -> Holdout:
    """Hold out `fraction` of the images of `data` (with all their captions) and write the three challenge files to
    `out`: train.npz (the other images, captions keeping their ids), test.clean.npz (ids 1..N in gallery order) and
    answers.npz (the true image of each test caption)."""
    test_img = held_out_images(data.image_names, fraction, seed)
    train_img = np.setdiff1d(np.arange(len(data.image_names)), test_img)
    tr_caps, tr_local = captions_and_local_images(data.cap2img, train_img)
    te_caps, te_local = captions_and_local_images(data.cap2img, test_img)
    if len(te_caps) == 0 or len(tr_caps) == 0:
        raise DataError(f"{data.path}: the holdout of seed {seed} leaves a side without captions")
    order = te_caps[gallery_order(te_local, seed)]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    labels = None if data.image_labels is None else data.image_labels[train_img]
    files = tuple(out / name for name in HOLDOUT_FILES)
    write_train_npz(files[0], caption_ids=data.caption_ids[tr_caps], caption_text=data.caption_text[tr_caps],
                    text=data.text[tr_caps], image=data.image[train_img], cap2img=tr_local,
                    image_names=data.image_names[train_img], image_labels=labels, label_names=data.label_names)
    ids = np.arange(1, len(order) + 1, dtype=np.int64)
    write_test_npz(files[1], ids=ids, text=data.caption_text[order], embeddings=data.text[order])
    truth = data.cap2img[order]
    write_answers_npz(files[2], ids=ids, image=data.image[truth], image_names=data.image_names[truth])
    return Holdout(len(train_img), len(tr_caps), len(test_img), len(order), -(-len(order) // GALLERY_SIZE), files)


__all__ = ["HOLDOUT_FILES", "Holdout", "held_out_images", "gallery_order", "write_holdout"]
