"""The window one WILLNEED reads, per device, from sysfs (checked against the kernel)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from spanwarm.pagecache.read_ahead import DEFAULT_WINDOW, hint_window
from spanwarm.pagecache.residency import evict, resident_bytes

MiB = 2**20


def test_a_device_without_a_backing_device_gets_the_kernels_default() -> None:
    assert hint_window(os.stat("/proc").st_dev) == DEFAULT_WINDOW


def test_one_willneed_of_the_window_is_read_whole_and_never_more(tmp_path: Path) -> None:
    """Whatever the device, a hint of exactly the window is not cut: every page of it
    arrives. (The window is never larger than what the kernel reads in one call.)"""
    path = tmp_path / "f.bin"
    window = hint_window(os.stat(tmp_path).st_dev)
    with path.open("wb") as f:
        f.write(os.urandom(window + 4 * MiB))
        os.fsync(f.fileno())
    evict(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        os.posix_fadvise(fd, 0, window + 4 * MiB, os.POSIX_FADV_WILLNEED)  # cut at the window
        deadline = time.monotonic() + 10
        while resident_bytes(fd, 0, window) < window and time.monotonic() < deadline:
            time.sleep(0.01)
        assert resident_bytes(fd, 0, window) == window
        time.sleep(0.1)
        if window >= MiB:  # the kernel's own cut: nothing past the window came in
            assert resident_bytes(fd, window, 4 * MiB) == 0
    finally:
        os.close(fd)
