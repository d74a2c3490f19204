"""The challenge npz reader: an open npz (a zip of .npy members) read by header, whole or streamed, every
failure a DataError, and the caption-to-image label in its three formats (dense bool one-hot, integer image
index, sparse CSR). latentsweep.trainers.data.sets builds the train, test and answer sets on it."""
from __future__ import annotations

import contextlib
import os
import struct
import sys
import threading
import zipfile
import zlib

import numpy as np
from numpy.lib import format as npformat

from latentsweep.trainers.core.errors import DataError, closest

# Dense-label bytes decoded (or encoded) per step: the real label is 125000 x 25000 bools = 3.1 GB, so it is streamed.
# A step is one inflate call's output, scanned while in cache: reading the real label took 10-15% less CPU at 1-4 MB
# than at 8 MB (at 32 MB, with zipfile's reader, the load peaked 0.10 GB above what it keeps).
LABEL_CHUNK_BYTES = 2 << 20
# Rows per step for finiteness checks, so the temporary bool mask stays at ROW_CHUNK x dim.
ROW_CHUNK = 8192
# Sparse label convention (CSR, scipy.sparse.save_npz names behind the prefix "captions/label_"):
#   captions/label_indptr int [Nc+1], captions/label_indices int [nnz] (image index of each stored entry),
#   optional captions/label_data [nnz] (entries equal to 0 are ignored),
#   optional captions/label_shape int [2] = (Nc, Ni), optional captions/label_format str "csr".
SPARSE_PREFIX = "captions/label_"
try:
    # ISA-L's inflate: the challenge's dense label (3.4 MB deflated to 3.1 GB) in 1.2 s against zlib's 6.6 s. A
    # dependency (pyproject), but a platform without its wheel gets zlib's inflate: the same bytes, slower.
    from isal import isal_zlib as _isal
except ImportError:
    _isal = None
# The default inflate back end: a module with decompressobj(wbits), crc32(data, value) and error, as zlib has.
INFLATE = _isal or zlib
# Errors that mean the zip container or a member's bytes are damaged.
_READ_ERRORS = (zipfile.BadZipFile, zlib.error, EOFError, ValueError, OSError, NotImplementedError) \
    + ((_isal.error,) if _isal is not None else ())
# Compressed bytes read from the file per step (the float members deflate about 1.08:1, the label about 900:1): at
# 256 KB an inflate call's output stays in cache, and the real captions/embeddings inflated into their array in about
# 2.7 CPU-s against 4.0 at 1 MB (isal; a loaded 2-core machine, 3 runs each).
INPUT_CHUNK = 256 << 10
# Stored (not deflated) bytes copied per step, so a stored matrix is never held twice whole.
STORED_CHUNK = 8 << 20
# Local file header: 30 fixed bytes ("PK\3\4", ..., name length at 26, extra length at 28), name, extra, data.
_LOCAL = struct.Struct("<4s22xHH")


INT64_MAX = np.iinfo(np.int64).max  # ids are stored as int64 everywhere


def _pread(file, lock: threading.Lock, size: int, offset: int) -> bytes:
    """`size` bytes of `file` at `offset` (fewer at its end); members read in threads share the one handle."""
    if hasattr(os, "pread"):  # no shared position: threads never wait on each other
        return os.pread(file.fileno(), size, offset)
    with lock:  # Windows
        file.seek(offset)
        return file.read(size)


class Member:
    """One zip member's bytes as a read-only stream (read, readinto, tell), inflated as read with `inflate`'s
    decompressobj (isal_zlib or zlib), its size and CRC-32 checked against the zip directory at its last byte."""

    def __init__(self, file, lock: threading.Lock, info: zipfile.ZipInfo, inflate=INFLATE):
        self._file, self._lock, self._crc32 = file, lock, inflate.crc32
        head = _pread(file, lock, _LOCAL.size, info.header_offset)
        if len(head) < _LOCAL.size or _LOCAL.unpack(head)[0] != zipfile.stringFileHeader:
            raise zipfile.BadZipFile(f"bad local file header of {info.filename}")
        if info.flag_bits & 0x1:
            raise NotImplementedError(f"{info.filename} is encrypted")
        if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise NotImplementedError(f"{info.filename}: compression method {info.compress_type} (only stored or "
                                      "deflated members are read)")
        _, name_len, extra_len = _LOCAL.unpack(head)
        self._pos = info.header_offset + _LOCAL.size + name_len + extra_len  # next unread byte of the member's data
        self._end = self._pos + info.compress_size
        self._inflater = inflate.decompressobj(-zlib.MAX_WBITS) if info.compress_type == zipfile.ZIP_DEFLATED \
            else None  # raw deflate, as zip stores it
        self._tail = b""  # compressed bytes read but not yet inflated
        self.size, self._want_crc, self._done, self._crc = info.file_size, info.CRC, 0, 0

    def tell(self) -> int:
        return self._done

    def read(self, n: int = -1) -> bytes:
        """Up to n bytes (all the rest when n < 0), fewer only at the member's end."""
        n = sys.maxsize if n is None or n < 0 else n
        pieces, got = [], 0
        while got < n:
            piece = self._next(n - got)
            if not piece:
                break
            pieces.append(piece)
            got += len(piece)
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def readinto(self, buf) -> int:
        """Fill `buf` (any writable buffer); the bytes written, fewer only at the member's end."""
        out = memoryview(buf).cast("B")
        got = 0
        while got < len(out):
            piece = self._next(len(out) - got)
            if not piece:
                break
            out[got:got + len(piece)] = piece
            got += len(piece)
        return got

    def _next(self, want: int) -> bytes:
        """The next 1..want bytes of the member's data, b"" after its last; checks its size and CRC at the end."""
        piece = self._stored(want) if self._inflater is None else self._inflated(want)
        if piece:
            self._done += len(piece)
            self._crc = self._crc32(piece, self._crc)
            if self._done > self.size:
                raise zipfile.BadZipFile(f"member data longer than the {self.size} bytes of its directory entry")
            if self._done == self.size and self._crc != self._want_crc:
                raise zipfile.BadZipFile("bad CRC-32 of the member's data")
        elif self._done < self.size:
            raise EOFError(f"member data ends after {self._done} of its {self.size} bytes")
        return piece

    def _stored(self, want: int) -> bytes:
        take = min(want, STORED_CHUNK, self._end - self._pos)
        piece = _pread(self._file, self._lock, take, self._pos)
        if len(piece) < take:
            raise EOFError("the file ends inside the member's data")
        self._pos += take
        return piece

    def _inflated(self, want: int) -> bytes:
        while not self._inflater.eof:
            if not self._tail and self._pos < self._end:
                take = min(INPUT_CHUNK, self._end - self._pos)
                self._tail = _pread(self._file, self._lock, take, self._pos)
                if len(self._tail) < take:
                    raise EOFError("the file ends inside the member's data")
                self._pos += take
            feed, last = self._tail, self._pos == self._end
            piece = self._inflater.decompress(feed, want)
            self._tail = self._inflater.unconsumed_tail
            if piece:
                return piece
            if last and not feed:  # all input given and nothing more came out
                raise EOFError("the member's deflated data ends before its end-of-stream marker")
        return b""


class Npz:
    """An open npz (zip of .npy members): headers, whole arrays and streamed reads, every failure a DataError."""

    def __init__(self, path, inflate=INFLATE):
        """inflate: the deflate back end of every member's read (isal_zlib, else zlib; see INFLATE)."""
        self.path, self.inflate = str(path), inflate
        if not os.path.isfile(self.path):
            raise DataError(f"{self.path}: file not found")
        try:
            self._file = open(self.path, "rb")
        except OSError as exc:
            raise DataError(f"{self.path}: cannot open ({exc})") from None
        self._lock = threading.Lock()
        try:
            self.zip = zipfile.ZipFile(self._file)
        except _READ_ERRORS as exc:
            self._file.close()
            raise DataError(f"{self.path}: not a readable npz (zip) file, truncated or corrupt ({exc})") from None
        self.keys = {name[:-4]: name for name in self.zip.namelist() if name.endswith(".npy")}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.zip.close()
        self._file.close()

    def error(self, key: str, message: str) -> DataError:
        return DataError(f"{self.path}: key '{key}': {message}")

    def require(self, key: str) -> str:
        if key not in self.keys:
            raise DataError(f"{self.path}: missing key '{key}'{closest(key, self.keys)}")
        return self.keys[key]

    @contextlib.contextmanager
    def open(self, key: str, to_end: bool = True):
        """Open one member; damaged bytes become a DataError naming the key.

        to_end: on a clean exit, require the member to end there (its last byte read checks its size and CRC-32).
        """
        try:
            f = Member(self._file, self._lock, self.zip.getinfo(self.require(key)), self.inflate)
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
            shape, fortran, dtype = _read_header(f)
            count = int(np.prod(shape, dtype=object))
            if dtype.hasobject:  # numpy's own refusal (allow_pickle=False), from the member's start
                with self.open(key) as again:
                    return npformat.read_array(again, allow_pickle=False)
            if count * dtype.itemsize != f.size - f.tell():
                raise self.error(key, f"header declares shape {shape} ({count * dtype.itemsize} bytes of {dtype}) "
                                      f"but the member holds {f.size - f.tell()} data bytes")
            # Read straight into the array in one call (numpy's read_array copies 16 MB pieces out of the stream).
            arr = np.empty(count, dtype)
            if arr.nbytes and f.readinto(arr.view(np.uint8)) != arr.nbytes:
                raise EOFError("the member's data ends early")
            return arr.reshape(shape[::-1]).T if fortran else arr.reshape(shape)

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


# numpy parses a header with ast.literal_eval, and CPython 3.11's AST constructor keeps its recursion depth per
# interpreter, not per thread: two threads parsing at once (the label's reader beside the arrays') can fail with
# "SystemError: AST constructor recursion depth mismatch" (python/cpython#106905). One header is parsed at a time.
_HEADER_LOCK = threading.Lock()


def _read_header(f):
    """(shape, fortran_order, dtype) from an open .npy stream, leaving it at the first data byte."""
    with _HEADER_LOCK:
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
