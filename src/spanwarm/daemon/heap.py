"""The daemon's heap: glibc settings and trims that give a large request's memory back.

A request of a million spans decodes to tens of MB of numpy arrays and temporaries. By
default glibc raises its mmap threshold each time such a block is freed (up to 32 MB), so
later arrays of that size come from the heap, where freed holes keep the daemon's RSS
high for as long as anything above them lives. Fixing the threshold at 128 KiB sends every
large array to its own mapping, returned to the system the moment it is freed; small
objects stay on the heap, trimmed after large requests.
"""

from __future__ import annotations

import ctypes
import gc
from typing import Any

__all__ = ["configure_heap", "trim_heap"]

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
_MMAP_THRESHOLD = 128 * 2**10

try:
    _libc: Any = ctypes.CDLL(None)
    _mallopt: Any = _libc.mallopt
    _malloc_trim: Any = _libc.malloc_trim
except AttributeError:  # not glibc: its allocator has its own policy
    _mallopt = _malloc_trim = None


def configure_heap() -> bool:
    """Fix glibc's mmap and trim thresholds for this process (once, at start). Returns
    whether they were set (False on other C libraries)."""
    if _mallopt is None:
        return False
    return bool(
        _mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)
        and _mallopt(_M_TRIM_THRESHOLD, 2 * _MMAP_THRESHOLD)
    )


def trim_heap(*, collect: bool) -> None:
    """Give freed heap memory back to the system (a cycle waits for the collector first
    when ``collect``). Takes tens of milliseconds: call it from a worker thread."""
    if collect:
        gc.collect()
    if _malloc_trim is not None:
        _malloc_trim(0)
