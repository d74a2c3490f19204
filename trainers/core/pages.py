"""Handing a mapped file's pages back once read: MADV_PAGEOUT (the page cache may drop them too) and, for the train
set's sealed read-only mapping, MADV_DONTNEED after each read (the page cache keeps them): the process no longer holds
them, and maps them again if it reads them again."""
from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import sys
import weakref
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
# The sealed mappings: (first byte, end, the np.memmap that owns it): a dead array's mapping is gone, never dropped.
_sealed: list[tuple[int, int, weakref.ref]] = []


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
    """Make a file-mapped array's mapping read-only (mprotect PROT_READ) and mapped a 4 KB page at a time
    (MADV_NOHUGEPAGE); whether it is sealed now (only an np.memmap with its mapping, on Linux).

    Why: `drop` hands a sealed mapping's pages back after every read. A write would land in a private copy of its
    page that a drop would lose, so a write is made impossible instead (a crash, with the Python stack where
    faulthandler is on). Where the page cache holds a file in huge pages, one row read maps the 2 MB around it: a
    batch of 512 scattered rows then maps most of the 0.41 GB of challenge-size training captions, a page at a time
    about 32 MB (the kernel's fault-around, 64 KB a read)."""
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
    _sealed.append((start, start + len(mm), weakref.ref(array)))
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
    for start, stop, ref in list(_sealed):
        array = ref()
        if array is None:
            with contextlib.suppress(ValueError):  # another thread's lookup removed it first
                _sealed.remove((start, stop, ref))
        elif start <= address < stop:
            array._mmap.madvise(mmap.MADV_DONTNEED)
            return


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


__all__ = ["WRITE_BLOCK", "Writer", "drop", "page_out", "seal"]
