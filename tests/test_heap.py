"""latentsweep.trainers.core.heap.release_free_heap hands freed heap pages back to the OS (glibc), which glibc alone
keeps resident."""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]  # the repository: the probe imports trainers from it
pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")

# Run in a fresh interpreter: the heap state of the test process (its earlier tests) must not decide the outcome.
PROBE = """
import ctypes, os
from latentsweep.trainers.core.heap import release_free_heap
page = os.sysconf("SC_PAGE_SIZE")
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * page
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
# A freed 16 MB block (mmapped) raises glibc's thresholds: later 1 MB blocks come from the heap, and up to 32 MB
# free at its top stays there.
libc.free(libc.malloc(16 << 20))
held = [libc.malloc(1 << 20) for _ in range(20)]
for p in held:
    ctypes.memset(p, 1, 1 << 20)  # touched: resident
for p in held:
    libc.free(p)
before = rss()
release_free_heap()
print(before - rss())
"""


def test_release_returns_freed_heap_pages_glibc_kept():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert int(out.stdout) > 15 << 20  # most of the 20 MB freed; glibc alone had kept it all
