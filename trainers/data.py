"""Challenge data files: read and validate train/test/answers npz files (written by trainers.data_writer, split by
image in trainers.splits)."""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import numpy as np

from trainers.errors import DataError
from trainers.heap import release_free_heap
from trainers.npz import SPARSE_PREFIX, Npz, check_kind, read_cap2img


@dataclass(frozen=True)
class TrainSet:
    path: str
    fingerprint: str
    caption_ids: np.ndarray  # int64 [Nc]
    caption_text: np.ndarray | None  # str [Nc]; None unless load_train(texts=True): training never reads it
    text: np.ndarray  # float32 [Nc, Dt]
    image: np.ndarray  # float32 [Ni, Di]
    cap2img: np.ndarray  # int64 [Nc], image index of each caption
    image_names: np.ndarray  # str [Ni]
    image_labels: np.ndarray | None = None  # bool [Ni, L]
    label_names: np.ndarray | None = None  # str [L]


@dataclass(frozen=True)
class TestSet:
    path: str
    fingerprint: str
    ids: np.ndarray  # int64 [N]
    text: np.ndarray  # str [N]
    embeddings: np.ndarray  # float32 [N, Dt]


def fingerprint(path) -> str:
    """First 16 hex characters of the sha256 of the file bytes (read in 1 MB blocks)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


def _check_metadata(npz: Npz, expected: dict[str, tuple[int, str]]) -> None:
    """Metadata keys are optional; when present they must agree with the arrays."""
    for name, (value, source) in expected.items():
        key = f"metadata/{name}"
        if key in npz.keys:
            arr = npz.array(key)
            if arr.dtype.kind not in "iu" or arr.size != 1:
                raise npz.error(key, f"has dtype {arr.dtype} and shape {arr.shape}, expected one integer")
            if int(arr.reshape(-1)[0]) != value:
                raise npz.error(key, f"says {int(arr.reshape(-1)[0])} but {source} gives {value}")


def load_train(path, *, texts: bool = False, label_chunk_rows: int | None = None) -> TrainSet:
    """Read and validate a challenge train.npz; the dense label is streamed, never held whole.

    texts: keep the caption texts (a holdout writes them); they are always checked, but otherwise dropped, since
    numpy stores them at the longest caption's width (4 bytes a character: 0.2 GB for 125,000 captions of up to 400).
    """
    with Npz(path) as npz:
        text = npz.matrix("captions/embeddings")
        nc = len(text)
        ids = _unique_ids(npz, "captions/ids", npz.vector("captions/ids", "i", nc, "captions/embeddings"))
        caption_text = npz.vector("captions/text", "U", nc, "captions/embeddings")
        caption_text = caption_text if texts else None
        image = npz.matrix("images/embeddings")
        ni = len(image)
        if ni < 2:  # `data check` must not pass a file that every `train` rejects at the split
            raise npz.error("images/embeddings", f"has {ni} image; a train file needs at least 2 (the validation "
                                                 f"images are held out from the training ones)")
        # names key the hash split and the submission's image lookup: a repeated name would put one image twice
        names = _unique_names(npz, "images/names", npz.vector("images/names", "U", ni, "images/embeddings"))
        cap2img = read_cap2img(npz, nc, ni, label_chunk_rows)
        labels = label_names = None
        if "images/labels" in npz.keys:
            labels = npz.array("images/labels")
            check_kind(npz, "images/labels", labels, "b", rank=2)
            if len(labels) != ni:
                raise npz.error("images/labels", f"has {len(labels)} rows but images/embeddings has {ni}")
            if "images/label_names" in npz.keys:
                label_names = npz.vector("images/label_names", "U", labels.shape[1], "images/labels (columns)")
        _check_metadata(npz, {
            "num_captions": (nc, "captions/embeddings rows"), "num_images": (ni, "images/embeddings rows"),
            "embedding_dim_text": (text.shape[1], "captions/embeddings columns"),
            "embedding_dim_image": (image.shape[1], "images/embeddings columns")})
    data = TrainSet(str(path), fingerprint(path), ids, caption_text, text, image, cap2img, names, labels, label_names)
    release_free_heap()  # the read buffers and the label's blocks, freed but kept resident by glibc (0.04 GB)
    return data


# The TrainSet this process read last (load_train_shared); one at most, so two files are never held for it.
_last_read: list[TrainSet] = []


def load_train_shared(path) -> TrainSet:
    """`load_train(path)`, except that the TrainSet this process read last is handed out again while `path` holds
    the same bytes (its sha256 fingerprint: 0.5 s at challenge size, against about 12 s for a read). A study run's
    pre-flight check and its trials, and a one-budget run's pick estimate and pick, then read the file once instead
    of up to five times. It stays loaded for the life of the process; callers treat a TrainSet as read-only, as the
    trials of one study always have (they share one)."""
    if _last_read:
        last = _last_read[0]
        try:
            same = os.path.realpath(last.path) == os.path.realpath(path) and last.fingerprint == fingerprint(path)
        except OSError:  # gone or unreadable now: load_train says so in its own words
            same = False
        if same:
            return last
    _last_read.clear()  # before reading: the old and the new file are never held together
    _last_read.append(load_train(path))
    return _last_read[0]


def _unique_ids(npz: Npz, key: str, ids: np.ndarray) -> np.ndarray:
    order = np.argsort(ids, kind="stable")
    dup = np.flatnonzero(ids[order][1:] == ids[order][:-1])
    if dup.size:
        raise npz.error(key, f"row {int(order[dup[0] + 1])} repeats id {int(ids[order[dup[0]]])}")
    return ids


def _unique_names(npz: Npz, key: str, names: np.ndarray) -> np.ndarray:
    uniq, first, counts = np.unique(names, return_index=True, return_counts=True)
    if (counts > 1).any():
        name = uniq[np.argmax(counts > 1)]
        rows = np.flatnonzero(names == name)[:2]
        raise npz.error(key, f"rows {int(rows[0])} and {int(rows[1])} both name image {str(name)[:80]!r}")
    return names


def load_test(path) -> TestSet:
    """Read and validate a test.clean.npz (captions only)."""
    with Npz(path) as npz:
        if "captions/label" in npz.keys or SPARSE_PREFIX + "indptr" in npz.keys:  # the labels make a train file
            raise DataError(f"{path}: a train file (it has captions/label), not a test file: pass the "
                            "test.clean.npz of the challenge or of `latentsweep data holdout`")
        emb = npz.matrix("captions/embeddings")
        ids = _unique_ids(npz, "captions/ids", npz.vector("captions/ids", "i", len(emb), "captions/embeddings"))
        text = npz.vector("captions/text", "U", len(emb), "captions/embeddings")
        _check_metadata(npz, {"num_captions": (len(emb), "captions/embeddings rows"),
                              "embedding_dim_text": (emb.shape[1], "captions/embeddings columns")})
    return TestSet(str(path), fingerprint(path), ids, text, emb)


def load_answers(path) -> tuple[np.ndarray, np.ndarray]:
    """Read an answer key: (ids int64 [N], true image embedding of each test caption float32 [N, Di])."""
    with Npz(path) as npz:
        image = npz.matrix("images/embeddings")
        ids = _unique_ids(npz, "captions/ids", npz.vector("captions/ids", "i", len(image), "images/embeddings"))
        if "images/names" in npz.keys:
            npz.vector("images/names", "U", len(image), "images/embeddings")
    return ids, image


def check_text_dim(test: TestSet, dim_in: int, expected_by: str = "the model expects") -> None:
    """Raise DataError when the test file's text embeddings are not `dim_in` wide (what the model was trained on)."""
    if test.embeddings.shape[1] != dim_in:
        raise DataError(f"{test.path}: captions/embeddings has dim {test.embeddings.shape[1]}, {expected_by} "
                        f"{dim_in}")


def describe_npz(path) -> dict:
    """{'kind': 'train'|'test'|'answers', 'label_format': ..., 'keys': {key: (shape, dtype)}} from headers only."""
    with Npz(path) as npz:
        keys = {}
        for key in npz.keys:
            shape, _, dtype = npz.header(key)
            keys[key] = (tuple(shape), dtype)
    if "captions/label" in keys:
        fmt = "index" if len(keys["captions/label"][0]) == 1 else "dense"
    else:
        fmt = "sparse" if SPARSE_PREFIX + "indptr" in keys else None
    if fmt is not None:
        kind = "train"
    elif "captions/embeddings" in keys:
        kind = "test"
    elif "images/embeddings" in keys:
        kind = "answers"
    else:
        raise DataError(f"{path}: cannot tell the file kind: no key 'captions/label' (train), "
                        f"'captions/embeddings' (test) or 'images/embeddings' (answers); keys: {sorted(keys)}")
    return {"kind": kind, "label_format": fmt, "keys": keys}
