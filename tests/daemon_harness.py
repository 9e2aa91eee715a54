"""A real daemon in a subprocess on a private socket, for integration tests."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from spanwarm.daemon.spawn import spawn_daemon
from spanwarm.residency import evict

__all__ = ["cold_file", "running_daemon"]


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
