"""Handing freed heap memory back to the operating system (glibc's `malloc_trim`) between phases of a run."""
from __future__ import annotations

import ctypes
import functools
from typing import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim  # the C library this process already runs on
    except (OSError, AttributeError):  # not glibc (musl, macOS): freed memory is handed back as that allocator does
        return None


def release_free_heap() -> None:
    """Return the heap's free pages to the OS now, where glibc would keep them resident.

    glibc raises its mmap threshold to the size of the largest block freed (up to 32 MB) and keeps up to twice that
    free at the top of its heap, plus whatever free blocks sit below live ones, all counted in the process's RSS.
    Reading a challenge-size train file frees 8 MB read buffers and the dense label's blocks: about 0.04 GB of it
    stayed resident under every later peak (benchmarks/memory_peak.py). Costs a few milliseconds; a no-op elsewhere.
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
