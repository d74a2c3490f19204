"""The challenge npz reader: an open npz (a zip of .npy members) read by header, whole or streamed, every
failure a DataError, and the caption-to-image label in its three formats (dense bool one-hot, integer image
index, sparse CSR). latentsweep.trainers.data.sets builds the train, test and answer sets on it."""
from __future__ import annotations

import contextlib
import os
import zipfile
import zlib

import numpy as np
from numpy.lib import format as npformat

from latentsweep.trainers.core.errors import DataError, closest

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


class Npz:
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
        check_kind(self, key, arr, kinds, rank=1)
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
        check_kind(self, key, arr, "f", rank=2)
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


def check_kind(npz: Npz, key: str, arr: np.ndarray, kinds: str, rank: int) -> None:
    ok_kinds = kinds + ("u" if "i" in kinds else "") + ("S" if "U" in kinds else "")
    if arr.dtype.kind not in ok_kinds:
        want = " or ".join(_KIND_NAMES[k] for k in kinds)
        raise npz.error(key, f"has dtype {arr.dtype}, expected {want}")
    if arr.ndim != rank:
        raise npz.error(key, f"has rank {arr.ndim} (shape {arr.shape}), expected rank {rank}")
    if arr.size == 0:
        raise npz.error(key, f"is empty (shape {arr.shape})")


def _check_one_per_row(npz: Npz, key: str, count: np.ndarray) -> None:
    bad = np.flatnonzero(count != 1)
    if bad.size:
        row = int(bad[0])
        raise npz.error(key, f"row {row} has {int(count[row])} images, expected exactly one "
                             f"({bad.size} such rows in all)")


def _dense_cap2img(npz: Npz, nc: int, ni: int, chunk_rows: int | None) -> np.ndarray:
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


def _index_cap2img(npz: Npz, nc: int, ni: int) -> np.ndarray:
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


def _sparse_cap2img(npz: Npz, nc: int, ni: int) -> np.ndarray:
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


def read_cap2img(npz: Npz, nc: int, ni: int, chunk_rows: int | None) -> np.ndarray:
    if "captions/label" not in npz.keys and SPARSE_PREFIX + "indptr" in npz.keys:
        return _sparse_cap2img(npz, nc, ni)
    shape, _, dtype = npz.header("captions/label")
    if len(shape) == 1 and dtype.kind in "iu":
        return _index_cap2img(npz, nc, ni)
    if len(shape) == 2 and dtype == np.bool_:
        return _dense_cap2img(npz, nc, ni, chunk_rows)
    raise npz.error("captions/label", f"has dtype {dtype} and shape {tuple(shape)}, expected dense bool "
                                      "[Nc, Ni] one-hot or integer [Nc] image index")
