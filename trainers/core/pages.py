"""The train set's mapped copy and the pages it costs the process: sealed read-only (`seal`), its rows read from its
file without mapping them (`take`), pages handed back where they were mapped (`drop`: MADV_DONTNEED, the page cache
keeps them; `page_out`: MADV_PAGEOUT, the page cache may drop them too), and saves that map it a block at a time."""
from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import os
import sys
import weakref
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

# madvise(2)'s MADV_PAGEOUT (Linux 5.4, linux/mman.h): reclaim the range's pages. Clean pages mapped from a file are
# freed; anonymous pages are swapped out at most (kept without swap), so it never loses data on any memory.
MADV_PAGEOUT = 21
# madvise(2)'s MADV_RANDOM (linux/mman.h): no read-ahead on faults in the range. A scattered read of a fifth of the
# rows otherwise reads the pages around each one back in with it (the kernel's read-around: every page, in effect).
MADV_RANDOM = 1
# mprotect(2)'s PROT_READ (sys/mman.h).
PROT_READ = 1
# The most bytes `Writer` hands its file at once: what a save maps of a sealed array between two drops. 32 MB is under
# 5% of the 0.67 GB of challenge-size training arrays, and a write of that size costs nothing beside its copy.
WRITE_BLOCK = 1 << 25
# Rows per read of a column block by `take` (a [TAKE_ROWS, D] scratch of whole rows, 16 MB at 1,024 float32 dims).
TAKE_ROWS = 4096
# `take` reads a sorted index window by window when it holds at least 1/DENSE of the rows it spans: reading up to 4x
# the bytes in few preads beat one pread per run there (100,000 sorted rows of 125,000: one per run took 4x as long).
DENSE = 4


@dataclass(frozen=True)
class _Sealed:
    """A sealed mapping: its bytes [start, stop), the np.memmap that owns it (a dead array's mapping is gone, never
    dropped), and what `take` reads its rows from: an open descriptor of its file and where the rows start there."""
    start: int
    stop: int
    ref: weakref.ref
    fd: int
    data: int  # the array's first byte in memory
    offset: int  # the same byte in the file
    shape: tuple[int, ...]
    dtype: np.dtype


_sealed: list[_Sealed] = []


@functools.cache
def _libc(name: str) -> Callable[..., int] | None:
    """The C library's function `name` (madvise, mprotect) on Linux, else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None


def page_out(buf: np.ndarray | torch.Tensor, scattered: bool = False) -> None:
    """MADV_PAGEOUT on the whole pages inside a contiguous CPU array's bytes (never a neighbour's page at either
    end); with `scattered`, MADV_RANDOM first: the rows read next are read without the pages around them. A no-op
    where madvise or the advice is missing (an older kernel answers EINVAL, ignored)."""
    if isinstance(buf, torch.Tensor):
        if buf.device.type != "cpu" or not buf.is_contiguous():
            return
        start, size = buf.data_ptr(), buf.numel() * buf.element_size()
    else:
        if not buf.flags.c_contiguous:
            return
        start, size = buf.__array_interface__["data"][0], buf.nbytes
    madvise = _libc("madvise")
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    last = (start + size) // mmap.PAGESIZE * mmap.PAGESIZE
    if madvise is None or last <= first:
        return
    for advice in (MADV_RANDOM, MADV_PAGEOUT) if scattered else (MADV_PAGEOUT,):
        madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), advice)


def seal(array: np.ndarray) -> bool:
    """Make a file-mapped array's mapping read-only (mprotect PROT_READ), asked to be mapped a 4 KB page at a time
    (MADV_NOHUGEPAGE), and readable by `take` (its file opened); whether it is sealed now (only an np.memmap with its
    mapping, on Linux).

    Why read-only: `drop` hands a sealed mapping's pages back. A write would land in a private copy of its page that
    a drop would lose, so a write is made impossible instead (a crash, with the Python stack where faulthandler is
    on). The advice is not enough on its own: on Linux 6.18 a read still maps the whole 2 MB folio the page cache
    holds it in, so rows are read with `take`, which maps nothing."""
    mm = getattr(array, "_mmap", None)
    madvise, mprotect = _libc("madvise"), _libc("mprotect")
    if mm is None or madvise is None or mprotect is None or not array.flags.c_contiguous:
        return False
    start = array.ctypes.data - array.offset % mmap.ALLOCATIONGRANULARITY  # np.memmap maps from that multiple
    if mprotect(ctypes.c_void_p(start), ctypes.c_size_t(len(mm)), PROT_READ) != 0:
        return False
    try:
        mm.madvise(mmap.MADV_NOHUGEPAGE)
    except (AttributeError, OSError):  # an older kernel or platform: rows map as the page cache holds them
        pass
    try:
        fd = os.open(array.filename, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except (OSError, TypeError):  # gone since it was mapped (evicted from the cache): `take` reads the mapping
        fd = -1
    else:
        weakref.finalize(array, os.close, fd)
    _sealed.append(_Sealed(start, start + len(mm), weakref.ref(array), fd, array.ctypes.data, array.offset,
                           array.shape, array.dtype))
    return True


def drop(x: np.ndarray | torch.Tensor) -> None:
    """MADV_DONTNEED on the whole of the sealed mapping (`seal`) that the CPU array or tensor `x` reads from: the
    process stops holding the pages it read (the page cache keeps them; a read maps them again, a minor fault, no
    disk). A no-op for memory of any other kind. Safe beside a reader in another thread, which maps its page again.
    The mapping is found by address among those sealed whose array is still alive (so still mapped)."""
    if isinstance(x, torch.Tensor):
        if x.device.type != "cpu" or torch.compiler.is_compiling():  # traced (torch.export, compile): no memory
            return
        address = x.data_ptr()
    else:
        address = x.__array_interface__["data"][0]
    found = _mapping(address)
    if found is not None:
        found[1]._mmap.madvise(mmap.MADV_DONTNEED)


def _mapping(address: int) -> tuple[_Sealed, np.memmap] | None:
    """The live sealed mapping holding `address`, with its array (kept alive while the caller uses it)."""
    for entry in list(_sealed):
        array = entry.ref()
        if array is None:
            with contextlib.suppress(ValueError):  # another thread's lookup removed it first
                _sealed.remove(entry)
        elif entry.start <= address < entry.stop:
            return entry, array
    return None


def take(base: np.ndarray | torch.Tensor, index, cols: slice = slice(None)) -> np.ndarray | torch.Tensor:
    """base[index, cols] for a 2-D base and int64 index [n] (numpy or torch), a new array of base's kind.

    Where base is rows of a sealed mapping (`seal`: the train set's cached copy), they are read from its file
    (pread) into the result, so the process never maps the file's pages at all. Why: on Linux 6.18 a read of a
    mapped row maps the whole page-cache folio it lies in, 2 MB, whatever the mapping's advice: 500 scattered rows of
    the challenge-size captions mapped 0.43 GB (docs/memory.md, "sixth round"). Elsewhere (a parsed set, a device
    tensor, a trace under torch.export) it is plain indexing."""
    src = _file_rows(base)
    if src is None:
        if isinstance(base, torch.Tensor):
            return base[torch.as_tensor(index, device=base.device), cols]
        return base[np.asarray(index), cols]
    entry, first = src
    idx = np.asarray(index.cpu() if isinstance(index, torch.Tensor) else index, np.int64).reshape(-1)
    rows = len(base)
    if idx.size and (idx.min() < -rows or idx.max() >= rows):
        raise IndexError(f"row index out of range for {rows} rows")
    c0, c1, step = cols.indices(base.shape[1])
    if step != 1:
        raise ValueError("take: columns must be a plain slice")
    out = np.empty((len(idx), max(c1 - c0, 0)), entry.dtype)
    _read_rows(entry, first, np.where(idx < 0, idx + rows, idx), c0, out)
    return torch.from_numpy(out) if isinstance(base, torch.Tensor) else out


def _file_rows(base) -> tuple[_Sealed, int] | None:
    """(the sealed mapping, base's first row there) where base is whole rows of a sealed mapping read on the CPU,
    else None."""
    if isinstance(base, torch.Tensor):
        if base.device.type != "cpu" or torch.compiler.is_compiling() or not base.is_contiguous():
            return None
        address = base.data_ptr()
    else:
        if not base.flags.c_contiguous:
            return None
        address = base.__array_interface__["data"][0]
    found = _mapping(address) if base.ndim == 2 else None
    if found is None or found[0].fd < 0 or len(found[0].shape) != 2:
        return None
    mine = torch.from_numpy(np.empty(0, found[0].dtype)).dtype if isinstance(base, torch.Tensor) else found[0].dtype
    if base.dtype != mine:
        return None
    entry, row_bytes = found[0], found[0].shape[1] * found[0].dtype.itemsize
    first, rest = divmod(address - entry.data, row_bytes)
    if rest or base.shape[1] != entry.shape[1] or first + len(base) > entry.shape[0]:
        return None
    return entry, first


def _read_rows(entry: _Sealed, first: int, idx: np.ndarray, c0: int, out: np.ndarray) -> None:
    """Rows first + idx [n] of the entry's file, columns c0 on (out's width), into out [n, c]. A sorted index that
    holds at least 1/DENSE of the rows it spans (a subset's rows, the keys of the knn model) is read TAKE_ROWS file
    rows at a time into a scratch; any other, with one pread per run of consecutive rows (whole rows), or per
    TAKE_ROWS rows of a run into a scratch (a column block)."""
    if not len(idx):
        return
    idx = idx + first
    if len(idx) > 1 and len(idx) * DENSE >= idx[-1] - idx[0] + 1 and bool(np.all(idx[1:] >= idx[:-1])):
        _read_windows(entry, idx, c0, out)
        return
    row_bytes = entry.shape[1] * entry.dtype.itemsize
    breaks = (np.flatnonzero(np.diff(idx) != 1) + 1).tolist()
    whole = out.shape[1] == entry.shape[1]
    scratch = None if whole else np.empty((min(TAKE_ROWS, len(idx)), entry.shape[1]), entry.dtype)
    for a, b in zip([0] + breaks, breaks + [len(idx)]):
        for s in range(a, b, len(idx) if whole else TAKE_ROWS):
            e = b if whole else min(b, s + TAKE_ROWS)
            dest = out[s:e] if whole else scratch[:e - s]
            _pread(entry.fd, memoryview(dest).cast("B"), entry.offset + int(idx[s]) * row_bytes)
            if not whole:
                out[s:e] = dest[:, c0:c0 + out.shape[1]]


def _read_windows(entry: _Sealed, idx: np.ndarray, c0: int, out: np.ndarray) -> None:
    """A sorted dense index's rows: each window of TAKE_ROWS file rows it touches read whole, its rows copied out."""
    row_bytes = entry.shape[1] * entry.dtype.itemsize
    scratch = np.empty((min(TAKE_ROWS, int(idx[-1] - idx[0]) + 1), entry.shape[1]), entry.dtype)
    s = 0
    while s < len(idx):
        r0 = int(idx[s])
        e = int(np.searchsorted(idx, r0 + len(scratch), side="left"))  # the index's rows inside this window
        window = scratch[:int(idx[e - 1]) - r0 + 1]
        _pread(entry.fd, memoryview(window).cast("B"), entry.offset + r0 * row_bytes)
        # np.take: a mixed (array, slice) index of whole rows copied 12x slower
        np.take(window[:, c0:c0 + out.shape[1]], idx[s:e] - r0, axis=0, out=out[s:e])
        s = e


def _pread(fd: int, buf: memoryview, offset: int) -> None:
    """Fill buf from the file at offset; a file shorter than its header said is an OSError."""
    done = 0
    while done < len(buf):
        got = os.preadv(fd, [buf[done:]], offset + done)
        if got <= 0:
            raise OSError(f"the data cache file (descriptor {fd}) ends before its rows do")
        done += got


class Writer:
    """A binary file that writes each buffer WRITE_BLOCK bytes at a time and `drop`s after each block (a no-op unless
    the buffer is a sealed mapping's). Why: torch.save writes a tensor's bytes in one call, and a knn model's
    checkpoint holds the training arrays its keys are rows of (the sealed mapping in a trial): one call maps all
    0.5 GB of challenge-size captions into the process at once."""

    def __init__(self, fh):
        self._fh = fh

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        if len(view) <= WRITE_BLOCK:
            return self._fh.write(view)
        whole = np.frombuffer(view, np.uint8)  # the bytes' address, for drop
        for start in range(0, len(view), WRITE_BLOCK):
            self._fh.write(view[start:start + WRITE_BLOCK])
            drop(whole)
        return len(view)

    def flush(self) -> None:
        self._fh.flush()


__all__ = ["TAKE_ROWS", "WRITE_BLOCK", "Writer", "drop", "page_out", "seal", "take"]
