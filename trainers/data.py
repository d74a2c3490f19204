"""Challenge data files: read and validate train/test/answers npz files (written by trainers.data_writer, split by
image in trainers.splits)."""
from __future__ import annotations

import contextlib
import hashlib
import os
import zipfile
import zlib
from dataclasses import dataclass

import numpy as np
from numpy.lib import format as npformat

from trainers.errors import DataError, closest
from trainers.heap import release_free_heap

# Dense-label bytes decoded (or encoded) per step: the real label is 125000 x 25000 bools = 3.1 GB, so it is streamed.
# zipfile's read joins its decompressed pieces, so a step briefly holds about 3x this (at 32 MB the load peaked
# 0.10 GB above what it keeps; benchmarks/memory_peak.py).
LABEL_CHUNK_BYTES = 8 << 20
# Rows per step for finiteness checks, so the temporary bool mask stays at ROW_CHUNK x dim.
ROW_CHUNK = 8192
# Sparse label convention (CSR, scipy.sparse.save_npz names behind the prefix "captions/label_"):
#   captions/label_indptr int [Nc+1], captions/label_indices int [nnz] (image index of each stored entry),
#   optional captions/label_data [nnz] (entries equal to 0 are ignored),
#   optional captions/label_shape int [2] = (Nc, Ni), optional captions/label_format str "csr".
SPARSE_PREFIX = "captions/label_"
# Errors that mean the zip container or a member's bytes are damaged.
_READ_ERRORS = (zipfile.BadZipFile, zlib.error, EOFError, ValueError, OSError, NotImplementedError)


INT64_MAX = np.iinfo(np.int64).max  # ids are stored as int64 everywhere


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


class _Npz:
    """An open npz (zip of .npy members): headers, whole arrays and streamed reads, every failure a DataError."""

    def __init__(self, path):
        self.path = str(path)
        if not os.path.isfile(self.path):
            raise DataError(f"{self.path}: file not found")
        try:
            self.zip = zipfile.ZipFile(self.path)
        except _READ_ERRORS as exc:
            raise DataError(f"{self.path}: not a readable npz (zip) file, truncated or corrupt ({exc})") from None
        self.keys = {name[:-4]: name for name in self.zip.namelist() if name.endswith(".npy")}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.zip.close()

    def error(self, key: str, message: str) -> DataError:
        return DataError(f"{self.path}: key '{key}': {message}")

    def require(self, key: str) -> str:
        if key not in self.keys:
            raise DataError(f"{self.path}: missing key '{key}'{closest(key, self.keys)}")
        return self.keys[key]

    @contextlib.contextmanager
    def open(self, key: str, to_end: bool = True):
        """Open one member; damaged bytes become a DataError naming the key.

        to_end: on a clean exit, require the member to end there (reading to the end makes zipfile check its CRC).
        """
        try:
            with self.zip.open(self.require(key)) as f:
                yield f
                if to_end and f.read(1):
                    raise ValueError("trailing bytes after the array")
        except DataError:
            raise
        except _READ_ERRORS as exc:
            raise self.error(key, f"cannot read, file truncated or corrupt ({exc})") from None

    def header(self, key: str):
        """(shape, fortran_order, dtype) of a member, reading only its first bytes."""
        with self.open(key, to_end=False) as f:
            return _read_header(f)

    def array(self, key: str) -> np.ndarray:
        """The whole member, after its header is checked against the member's size: a hostile header declaring a
        huge shape would otherwise make numpy allocate it (terabytes) before noticing the data is missing."""
        with self.open(key) as f:
            shape, _, dtype = _read_header(f)
            declared = int(np.prod(shape, dtype=object)) * dtype.itemsize
            if not dtype.hasobject and declared != self.zip.getinfo(self.keys[key]).file_size - f.tell():
                raise self.error(key, f"header declares shape {shape} ({declared} bytes of {dtype}) but the member "
                                      f"holds {self.zip.getinfo(self.keys[key]).file_size - f.tell()} data bytes")
            f.seek(0)
            return npformat.read_array(f, allow_pickle=False)

    def vector(self, key: str, kinds: str, n: int | None = None, ref: str = "") -> np.ndarray:
        """A rank-1 array of dtype kind in `kinds` ('i' ints, 'U' text, 'b' bool), optionally of length n."""
        arr = self.array(key)
        _check_kind(self, key, arr, kinds, rank=1)
        if n is not None and len(arr) != n:
            raise self.error(key, f"has {len(arr)} rows but {ref} has {n}")
        if "i" in kinds and arr.dtype.kind in "iu":
            if arr.dtype.kind == "u" and len(arr) and int(arr.max()) > INT64_MAX:  # astype would wrap negative
                row = int(np.argmax(arr))
                raise self.error(key, f"row {row} has id {int(arr[row])}, above the int64 maximum {INT64_MAX}")
            return arr.astype(np.int64, copy=False)
        if "U" in kinds and arr.dtype.kind == "S":
            try:
                return np.char.decode(arr, "utf-8")
            except UnicodeDecodeError as exc:
                row = next(i for i, v in enumerate(arr.tolist()) if not _utf8(v))
                raise self.error(key, f"row {row} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        return arr

    def matrix(self, key: str) -> np.ndarray:
        """A non-empty, finite float32 [N, D] embedding matrix."""
        arr = self.array(key)
        _check_kind(self, key, arr, "f", rank=2)
        wide = arr.dtype != np.float32
        with np.errstate(over="ignore"):  # a value beyond float32 becomes Inf, reported below in one line
            arr = arr.astype(np.float32, copy=False)
        for start in range(0, len(arr), ROW_CHUNK):
            bad = ~np.isfinite(arr[start:start + ROW_CHUNK]).all(axis=1)
            if bad.any():
                raise self.error(key, f"row {start + int(np.argmax(bad))} has NaN or Inf values"
                                      + (" (or values beyond the float32 range)" if wide else ""))
        return arr


def _read_header(f):
    """(shape, fortran_order, dtype) from an open .npy stream, leaving it at the first data byte."""
    version = npformat.read_magic(f)
    return (npformat.read_array_header_1_0 if version == (1, 0) else npformat.read_array_header_2_0)(f)


_KIND_NAMES = {"f": "float", "i": "integer", "U": "unicode text", "b": "bool"}


def _check_kind(npz: _Npz, key: str, arr: np.ndarray, kinds: str, rank: int) -> None:
    ok_kinds = kinds + ("u" if "i" in kinds else "") + ("S" if "U" in kinds else "")
    if arr.dtype.kind not in ok_kinds:
        want = " or ".join(_KIND_NAMES[k] for k in kinds)
        raise npz.error(key, f"has dtype {arr.dtype}, expected {want}")
    if arr.ndim != rank:
        raise npz.error(key, f"has rank {arr.ndim} (shape {arr.shape}), expected rank {rank}")
    if arr.size == 0:
        raise npz.error(key, f"is empty (shape {arr.shape})")


def fingerprint(path) -> str:
    """First 16 hex characters of the sha256 of the file bytes (read in 1 MB blocks)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


def _check_one_per_row(npz: _Npz, key: str, count: np.ndarray) -> None:
    bad = np.flatnonzero(count != 1)
    if bad.size:
        row = int(bad[0])
        raise npz.error(key, f"row {row} has {int(count[row])} images, expected exactly one "
                             f"({bad.size} such rows in all)")


def _dense_cap2img(npz: _Npz, nc: int, ni: int, chunk_rows: int | None) -> np.ndarray:
    """Stream a dense bool [Nc, Ni] one-hot label out of its zip member, chunk by chunk, into int64 [Nc]."""
    key = "captions/label"
    cap2img = np.full(nc, -1, np.int64)
    count = np.zeros(nc, np.int64)
    with npz.open(key) as f:
        shape, fortran, _ = _read_header(f)
        if tuple(shape) != (nc, ni):
            raise npz.error(key, f"has shape {tuple(shape)} but captions/embeddings x images/embeddings "
                                 f"rows give ({nc}, {ni})")
        # Storage order decides what a contiguous "row" of bytes is: a caption (C order) or an image (Fortran).
        major, minor = (ni, nc) if fortran else (nc, ni)
        step = chunk_rows or max(1, LABEL_CHUNK_BYTES // minor)
        for start in range(0, major, step):
            rows = min(step, major - start)
            buf = f.read(rows * minor)
            if len(buf) != rows * minor:
                raise npz.error(key, f"data ends at row {start + len(buf) // minor}, truncated")
            block = np.frombuffer(buf, np.bool_).reshape(rows, minor)
            if not fortran:
                # Fast path (argmax on bools is ~4x faster than nonzero): a True at every row's argmax and as
                # many Trues as rows means exactly one per row.
                first = block.argmax(axis=1)
                if np.count_nonzero(block) == rows and block[np.arange(rows), first].all():
                    cap2img[start:start + rows], count[start:start + rows] = first, 1
                    continue
            r, c = np.nonzero(block)  # general path: Fortran order, or a chunk with a bad row to count exactly
            cap, img = (c, r + start) if fortran else (r + start, c)
            count += np.bincount(cap, minlength=nc)
            cap2img[cap] = img
    _check_one_per_row(npz, key, count)
    return cap2img


def _index_cap2img(npz: _Npz, nc: int, ni: int) -> np.ndarray:
    key = "captions/label"
    cap2img = npz.vector(key, "i", nc, "captions/embeddings")
    bad = np.flatnonzero((cap2img < 0) | (cap2img >= ni))
    if bad.size:
        raise npz.error(key, f"row {int(bad[0])} has image index {int(cap2img[bad[0]])}, "
                             f"outside [0, {ni}) of images/embeddings")
    return cap2img


def _utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _sparse_cap2img(npz: _Npz, nc: int, ni: int) -> np.ndarray:
    """Read the CSR label (see SPARSE_PREFIX) into int64 [Nc]."""
    p = SPARSE_PREFIX
    if p + "format" in npz.keys:
        fmt = npz.array(p + "format").reshape(-1)[0]
        fmt = fmt.decode() if isinstance(fmt, bytes) else str(fmt)
        if fmt != "csr":
            raise npz.error(p + "format", f"is '{fmt}', only 'csr' is supported")
    shape = tuple(int(v) for v in npz.vector(p + "shape", "i")) if p + "shape" in npz.keys else (nc, ni)
    if shape != (nc, ni):
        raise npz.error(p + "shape", f"is {shape}, expected ({nc}, {ni}) from captions/embeddings x "
                                     "images/embeddings rows")
    indptr = npz.vector(p + "indptr", "i", nc + 1, "captions/embeddings (+1)")
    indices = npz.vector(p + "indices", "i")
    if indptr[0] != 0 or indptr[-1] != len(indices) or np.any(np.diff(indptr) < 0):
        raise npz.error(p + "indptr", f"must start at 0, never decrease and end at {len(indices)} "
                                      f"(length of {p}indices)")
    keep = np.ones(len(indices), bool)
    if p + "data" in npz.keys:
        keep = npz.vector(p + "data", "ibf", len(indices), p + "indices") != 0
    bad = np.flatnonzero((indices < 0) | (indices >= ni))
    if bad.size:
        raise npz.error(p + "indices", f"entry {int(bad[0])} is image {int(indices[bad[0]])}, outside [0, {ni})")
    rows = np.repeat(np.arange(nc), np.diff(indptr))[keep]
    _check_one_per_row(npz, "captions/label", np.bincount(rows, minlength=nc))
    cap2img = np.empty(nc, np.int64)
    cap2img[rows] = indices[keep]
    return cap2img


def _read_cap2img(npz: _Npz, nc: int, ni: int, chunk_rows: int | None) -> np.ndarray:
    if "captions/label" not in npz.keys and SPARSE_PREFIX + "indptr" in npz.keys:
        return _sparse_cap2img(npz, nc, ni)
    shape, _, dtype = npz.header("captions/label")
    if len(shape) == 1 and dtype.kind in "iu":
        return _index_cap2img(npz, nc, ni)
    if len(shape) == 2 and dtype == np.bool_:
        return _dense_cap2img(npz, nc, ni, chunk_rows)
    raise npz.error("captions/label", f"has dtype {dtype} and shape {tuple(shape)}, expected dense bool "
                                      "[Nc, Ni] one-hot or integer [Nc] image index")


def _check_metadata(npz: _Npz, expected: dict[str, tuple[int, str]]) -> None:
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
    with _Npz(path) as npz:
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
        cap2img = _read_cap2img(npz, nc, ni, label_chunk_rows)
        labels = label_names = None
        if "images/labels" in npz.keys:
            labels = npz.array("images/labels")
            _check_kind(npz, "images/labels", labels, "b", rank=2)
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


def _unique_ids(npz: _Npz, key: str, ids: np.ndarray) -> np.ndarray:
    order = np.argsort(ids, kind="stable")
    dup = np.flatnonzero(ids[order][1:] == ids[order][:-1])
    if dup.size:
        raise npz.error(key, f"row {int(order[dup[0] + 1])} repeats id {int(ids[order[dup[0]]])}")
    return ids


def _unique_names(npz: _Npz, key: str, names: np.ndarray) -> np.ndarray:
    uniq, first, counts = np.unique(names, return_index=True, return_counts=True)
    if (counts > 1).any():
        name = uniq[np.argmax(counts > 1)]
        rows = np.flatnonzero(names == name)[:2]
        raise npz.error(key, f"rows {int(rows[0])} and {int(rows[1])} both name image {str(name)[:80]!r}")
    return names


def load_test(path) -> TestSet:
    """Read and validate a test.clean.npz (captions only)."""
    with _Npz(path) as npz:
        emb = npz.matrix("captions/embeddings")
        ids = _unique_ids(npz, "captions/ids", npz.vector("captions/ids", "i", len(emb), "captions/embeddings"))
        text = npz.vector("captions/text", "U", len(emb), "captions/embeddings")
        _check_metadata(npz, {"num_captions": (len(emb), "captions/embeddings rows"),
                              "embedding_dim_text": (emb.shape[1], "captions/embeddings columns")})
    return TestSet(str(path), fingerprint(path), ids, text, emb)


def load_answers(path) -> tuple[np.ndarray, np.ndarray]:
    """Read an answer key: (ids int64 [N], true image embedding of each test caption float32 [N, Di])."""
    with _Npz(path) as npz:
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
    with _Npz(path) as npz:
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
