"""Handing a mapped file's pages back once read (madvise MADV_PAGEOUT): the process no longer holds them (the page
cache may, as after a plain read), and reads them from the file again if it reads them again."""
from __future__ import annotations

import ctypes
import functools
import mmap
import sys
from typing import Callable

import numpy as np
import torch

# madvise(2)'s MADV_PAGEOUT (Linux 5.4, linux/mman.h): reclaim the range's pages. Clean pages mapped from a file are
# freed; anonymous pages are swapped out at most (kept without swap), so it never loses data on any memory.
MADV_PAGEOUT = 21
# madvise(2)'s MADV_RANDOM (linux/mman.h): no read-ahead on faults in the range. A scattered read of a fifth of the
# rows otherwise reads the pages around each one back in with it (the kernel's read-around: every page, in effect).
MADV_RANDOM = 1


@functools.cache
def _madvise() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).madvise
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
    madvise = _madvise()
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    last = (start + size) // mmap.PAGESIZE * mmap.PAGESIZE
    if madvise is None or last <= first:
        return
    for advice in (MADV_RANDOM, MADV_PAGEOUT) if scattered else (MADV_PAGEOUT,):
        madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), advice)


__all__ = ["page_out"]
