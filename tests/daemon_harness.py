"""A real daemon in a subprocess on a private socket, for integration tests."""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from spanwarm.pagecache.memory_map import map_range, unmap
from spanwarm.pagecache.residency import evict
from spanwarm.testing.spawn import spawn_daemon

__all__ = ["cold_file", "fuse_file", "pinned", "running_daemon"]


running_daemon = spawn_daemon


def cold_file(path: Path, size: int, *, seed: int = 0) -> Path:
    """A file of random bytes, written, synced and evicted from the page cache."""
    rng = np.random.default_rng(seed)
    with open(path, "wb") as f:
        for start in range(0, size, 16 * 2**20):
            f.write(rng.integers(0, 256, min(16 * 2**20, size - start), dtype=np.uint8).tobytes())
        f.flush()
        os.fsync(f.fileno())
    evict(path)
    return path


@contextlib.contextmanager
def fuse_file(tmp_path: Path, name: str, size: int, **knobs: Any) -> Iterator[tuple[Any, Path]]:
    """A file of ``size`` random bytes on an emulated FUSE mount (``slowfs``; ``knobs``
    override its preset's): the mount and the file's path there. Skips the test where FUSE
    is not available."""
    from spanwarm.testing.slowfs import fuse_available, mount

    if (reason := fuse_available()) is not None:
        pytest.skip(reason)
    source = tmp_path / "source"
    source.mkdir()
    (source / name).write_bytes(os.urandom(size))
    with mount(source, tmp_path / "mnt", **knobs) as fs:
        yield fs, fs.path(name)


@contextlib.contextmanager
def pinned(fd: int, offset: int, length: int) -> Iterator[None]:
    """Read ``[offset, offset + length)`` of open file ``fd`` (page-aligned offset) in,
    and only that, and keep it mapped and locked while the block runs: this VM reclaims
    idle page cache a few pages at a time, which would change what a test finds resident."""
    address = map_range(fd, offset, length)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        # MADV_RANDOM: locking faults the range in without reading around it.
        if libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), mmap.MADV_RANDOM):
            raise OSError(ctypes.get_errno(), "madvise failed")
        if libc.mlock(ctypes.c_void_p(address), ctypes.c_size_t(length)) != 0:
            raise OSError(ctypes.get_errno(), "mlock failed")
        yield
    finally:
        unmap(address, length)
