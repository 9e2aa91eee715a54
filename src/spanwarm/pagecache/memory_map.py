"""Read-only mappings of file ranges through libc, for mincore and MADV_POPULATE_READ.

ctypes ``CDLL`` calls release the GIL, so worker threads overlap while the kernel
faults pages in; Python's own ``mmap.madvise`` would hold it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["MADV_POPULATE_READ", "madvise", "map_range", "mapped", "mincore", "populate", "unmap"]

MADV_POPULATE_READ = 22  # Linux 5.14+; not in the mmap module of Python 3.11

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.restype = ctypes.c_int
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mincore.restype = ctypes.c_int
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_MAP_FAILED = ctypes.c_void_p(-1).value


def _errno_error(call: str) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"{call}: {os.strerror(err)}")


def map_range(fd: int, offset: int, length: int, *, flags: int = mmap.MAP_SHARED) -> int:
    """``mmap(PROT_READ)`` of ``[offset, offset + length)`` (page-aligned offset); the address."""
    addr = _libc.mmap(None, length, mmap.PROT_READ, flags, fd, offset)
    if addr is None or addr == _MAP_FAILED:
        raise _errno_error("mmap")
    return int(addr)


def unmap(addr: int, length: int) -> None:
    _libc.munmap(addr, length)


@contextmanager
def mapped(fd: int, offset: int, length: int, *, flags: int = mmap.MAP_SHARED) -> Iterator[int]:
    """The address of a PROT_READ mapping of ``[offset, offset + length)`` (page-aligned
    ``offset``), unmapped when the block ends. ``fd`` -1 with MAP_ANONYMOUS maps memory."""
    addr = map_range(fd, offset, length, flags=flags)
    try:
        yield addr
    finally:
        unmap(addr, length)


def madvise(addr: int, length: int, advice: int) -> int:
    """``madvise(2)``; returns 0 or the errno, for the caller to interpret."""
    return 0 if _libc.madvise(addr, length, advice) == 0 else ctypes.get_errno()


def mincore(addr: int, length: int) -> bytearray:
    """One byte per page of the mapping; bit 0 set when the page is resident."""
    pages = (length + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = bytearray(pages)
    if _libc.mincore(addr, length, (ctypes.c_ubyte * pages).from_buffer(vec)) != 0:
        raise _errno_error("mincore")
    return vec


def populate(addr: int, length: int) -> int:
    """Fault a mapped range in (``MADV_POPULATE_READ``) without read-ahead; 0 or the errno.

    ``MADV_RANDOM`` first: a fault that finds a page carrying a read-ahead mark (left by
    another reader's read-ahead window) would otherwise read the 8-16 MiB that follow it,
    bytes nobody asked for."""
    madvise(addr, length, mmap.MADV_RANDOM)
    return madvise(addr, length, MADV_POPULATE_READ)
