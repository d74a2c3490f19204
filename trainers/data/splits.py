"""Image-level splits of a train set (hash hold-out and k folds): always by image, so no image has captions on both
sides; and the captions of a set of images."""
from __future__ import annotations

import hashlib
import numbers

import numpy as np

from latentsweep.trainers.core.errors import ConfigError


def _md5_unit(text: str) -> float:
    """Map a string to [0, 1) through the first 8 bytes of its MD5 (same value on every machine)."""
    return int.from_bytes(hashlib.md5(text.encode("utf-8")).digest()[:8], "big") / 2.0 ** 64


def _require_both_sides(train: np.ndarray, val: np.ndarray, split: str, n_images: int, note: str = "") -> None:
    """The one empty-split check: a split that leaves no training or no validation image cannot train."""
    if not len(train) or not len(val):
        raise ConfigError(f"{split} leaves an empty {'validation' if not len(val) else 'training'} side out of "
                          f"{n_images} images{note}")


def split_by_hash(image_names, val_ratio: float, salt: str = "") -> tuple[np.ndarray, np.ndarray]:
    """(train_img_idx, val_img_idx): an image goes to validation when MD5(salt + name) in [0, 1) < val_ratio."""
    if isinstance(val_ratio, bool) or not isinstance(val_ratio, numbers.Real) or not 0 < val_ratio < 1:
        raise ConfigError(f"val_ratio must be a number in (0, 1), got {val_ratio!r}")
    unit = np.array([_md5_unit(f"{salt}{name}") for name in image_names], np.float64)
    train, val = np.flatnonzero(unit >= val_ratio), np.flatnonzero(unit < val_ratio)
    _require_both_sides(train, val, f"val_ratio={val_ratio}", len(unit), f" (salt '{salt}')")
    return train, val


def kfold_by_image(image_names, n_folds: int, fold: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(train_img_idx, val_img_idx) of fold `fold`: images sorted by MD5(seed:name), dealt round-robin into folds.

    The one check of fold arguments (latentsweep.trainers.config.validate checks data.fold < data.n_folds before any data is read)."""
    n = len(image_names)
    if isinstance(n_folds, bool) or not isinstance(n_folds, numbers.Integral) or not 2 <= n_folds <= max(n, 2):
        raise ConfigError(f"n_folds must be an integer in [2, {max(n, 2)}] (number of images), got {n_folds!r}")
    if isinstance(fold, bool) or not isinstance(fold, numbers.Integral) or not 0 <= fold < n_folds:
        raise ConfigError(f"fold must be an integer in [0, {n_folds}), got {fold!r}")
    fold_of = fold_assignment(image_names, n_folds, seed)
    train, val = np.flatnonzero(fold_of != fold), np.flatnonzero(fold_of == fold)
    _require_both_sides(train, val, f"fold {fold} of n_folds={n_folds}", n)
    return train, val


def fold_assignment(image_names, n_folds: int, seed: int = 0) -> np.ndarray:
    """int64 [Ni]: each image's fold, images sorted by MD5(seed:name) and dealt round-robin (sizes differ by <= 1)."""
    keys = [hashlib.md5(f"{seed}:{name}".encode("utf-8")).digest() for name in image_names]
    fold_of = np.empty(len(keys), np.int64)
    fold_of[sorted(range(len(keys)), key=keys.__getitem__)] = np.arange(len(keys)) % n_folds
    return fold_of


def captions_of(cap2img, img_idx) -> np.ndarray:
    """Indices (int64, ascending) of the captions whose image is in img_idx."""
    cap2img, img_idx = np.asarray(cap2img, np.int64), np.asarray(img_idx, np.int64)
    size = int(max(cap2img.max(initial=-1), img_idx.max(initial=-1))) + 1
    mask = np.zeros(size, bool)
    mask[img_idx] = True
    return np.flatnonzero(mask[cap2img]) if len(cap2img) else np.zeros(0, np.int64)


def captions_and_local_images(cap2img, img_idx) -> tuple[np.ndarray, np.ndarray]:
    """(caps, local): the captions of the images img_idx (as captions_of) and each one's image as a position in
    img_idx (int64 [len(caps)]), for galleries and subsets made of those images only. img_idx must be distinct."""
    cap2img, img_idx = np.asarray(cap2img, np.int64), np.asarray(img_idx, np.int64)
    caps = captions_of(cap2img, img_idx)
    position = np.full(int(max(cap2img.max(initial=-1), img_idx.max(initial=-1))) + 1, -1, np.int64)
    position[img_idx] = np.arange(len(img_idx))
    return caps, position[cap2img[caps]]
