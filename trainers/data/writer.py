"""Writers of challenge npz files (train / test / answers), atomic, the dense label encoded in row chunks: the inverse
of the readers in latentsweep.trainers.data.sets (synthetic data, the demo data set and tests write with these)."""
from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
from numpy.lib import format as npformat

from latentsweep.trainers.data.npz import LABEL_CHUNK_BYTES, SPARSE_PREFIX
from latentsweep.trainers.core.errors import ConfigError, DataError, closest
from latentsweep.trainers.core.io import atomic_write


def _write_npz(path, members: list[tuple[str, object]]) -> Path:
    """Write (key, array-or-writer) members as a compressed npz (np.savez_compressed layout), atomically
    (latentsweep.trainers.core.io.atomic_write: zipfile writes into the temporary file, which replaces `path` only when complete)."""
    path = Path(path)
    with atomic_write(path, "wb", parents=False) as fh:
        with zipfile.ZipFile(fh, "w", zipfile.ZIP_DEFLATED, allowZip64=True) as zf:
            for key, value in members:
                with zf.open(key + ".npy", "w", force_zip64=True) as f:
                    if callable(value):
                        value(f)
                    else:
                        npformat.write_array(f, np.asanyarray(value), allow_pickle=False)
    return path


def _dense_label_writer(cap2img: np.ndarray, ni: int, chunk_rows: int | None):
    """A member writer emitting the one-hot bool [Nc, Ni] label in row chunks (never the whole matrix)."""
    def write(f) -> None:
        nc = len(cap2img)
        npformat.write_array_header_1_0(f, {"descr": npformat.dtype_to_descr(np.dtype(bool)),
                                            "fortran_order": False, "shape": (nc, ni)})
        step = chunk_rows or max(1, LABEL_CHUNK_BYTES // max(ni, 1))
        for start in range(0, nc, step):
            idx = cap2img[start:start + step]
            block = np.zeros((len(idx), ni), np.uint8)  # uint8 0/1 has the same bytes as numpy bool
            block[np.arange(len(idx)), idx] = 1
            f.write(memoryview(block.reshape(-1)))
    return write


def _label_members(cap2img: np.ndarray, ni: int, label_format: str, chunk_rows: int | None) -> list:
    nc = len(cap2img)
    if label_format == "dense":
        return [("captions/label", _dense_label_writer(cap2img, ni, chunk_rows))]
    if label_format == "index":
        return [("captions/label", cap2img)]
    if label_format == "sparse":
        p = SPARSE_PREFIX
        return [(p + "data", np.ones(nc, bool)), (p + "indices", cap2img), (p + "indptr", np.arange(nc + 1)),
                (p + "shape", np.array([nc, ni], np.int64)), (p + "format", np.array("csr"))]
    raise ConfigError(f"label_format '{label_format}' is unknown{closest(label_format, ['dense', 'index', 'sparse'])}")


def _metadata(**values: int) -> list:
    return [(f"metadata/{k}", np.array([v], np.int64)) for k, v in values.items()]


def write_train_npz(path, *, caption_ids, caption_text, text, image, cap2img, image_names, image_labels=None,
                    label_names=None, label_format: str = "dense", label_chunk_rows: int | None = None) -> Path:
    """Write a challenge-layout train.npz; the dense label is encoded in row chunks straight into the zip member.

    label_format: 'dense' (the challenge layout), or 'index' / 'sparse' (the other layouts load_train accepts).
    """
    text, image = np.asarray(text, np.float32), np.asarray(image, np.float32)
    cap2img = np.asarray(cap2img, np.int64)
    nc, ni = len(text), len(image)
    if len(cap2img) != nc or (nc and (cap2img.min() < 0 or cap2img.max() >= ni)):
        raise DataError(f"{path}: key 'captions/label': cap2img needs {nc} image indices in [0, {ni})")
    members = _metadata(num_captions=nc, num_images=ni, embedding_dim_text=text.shape[1],
                        embedding_dim_image=image.shape[1])
    members += [("captions/ids", np.asarray(caption_ids, np.int64)), ("captions/text", np.asarray(caption_text, str)),
                ("captions/embeddings", text)]
    members += _label_members(cap2img, ni, label_format, label_chunk_rows)
    members += [("images/names", np.asarray(image_names, str)), ("images/embeddings", image)]
    if image_labels is not None:
        members.append(("images/labels", np.asarray(image_labels, bool)))
        if label_names is not None:
            members.append(("images/label_names", np.asarray(label_names, str)))
    return _write_npz(path, members)


def write_test_npz(path, *, ids, text, embeddings) -> Path:
    """Write a test.clean.npz: captions only (ids, text, embeddings) plus metadata."""
    emb = np.asarray(embeddings, np.float32)
    return _write_npz(path, _metadata(num_captions=len(emb), embedding_dim_text=emb.shape[1]) + [
        ("captions/ids", np.asarray(ids, np.int64)), ("captions/text", np.asarray(text, str)),
        ("captions/embeddings", emb)])


def write_answers_npz(path, *, ids, image, image_names) -> Path:
    """Write an answer key: the true image embedding (and name) of each test caption, in test order."""
    return _write_npz(path, [("captions/ids", np.asarray(ids, np.int64)),
                             ("images/embeddings", np.asarray(image, np.float32)),
                             ("images/names", np.asarray(image_names, str))])
