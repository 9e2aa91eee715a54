"""bench.slowfs, the emulated network mount: content, counters, costs, page cache.

Timing assertions are lower bounds only: a loaded machine may be slower, never faster.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from bench.slowfs import Preset, SlowFS, fuse_available, mount
from spanwarm.residency import evict, file_residency

_reason = fuse_available()
if _reason is not None:
    pytest.skip(_reason, allow_module_level=True)

MiB = 1 << 20
# Scattered reads land farther apart than the stream tolerance, so each one is a seek.
SLOW = Preset("test-slow", latency_s=0.020, stream_bytes_per_s=64 * MiB, total_bytes_per_s=None)

Mount = Callable[[Preset | str], SlowFS]


@pytest.fixture
def source(tmp_path: Path) -> Path:
    path = tmp_path / "src"
    path.mkdir()
    return path


@pytest.fixture
def mounted(tmp_path: Path, source: Path) -> Iterator[Mount]:
    """Mount ``source`` with a preset; unmounted at teardown, whatever the test did."""
    with ExitStack() as stack:

        def mount_with(preset: Preset | str) -> SlowFS:
            return stack.enter_context(mount(source, tmp_path / "mnt", preset))

        yield mount_with


def _read_all(path: Path) -> bytes:
    with path.open("rb", buffering=0) as f:
        return f.read()


def test_content_and_bytes_served_once_across_opens(source: Path, mounted: Mount) -> None:
    data = os.urandom(8 * MiB)
    (source / "f.bin").write_bytes(data)
    fs = mounted("local")
    path = fs.path("f.bin")
    evict(path)

    assert _read_all(path) == data
    first = fs.stats()
    assert first["files"]["f.bin"]["bytes"] == 8 * MiB
    assert first["bytes"] == 8 * MiB  # and reading the stats file counts nothing

    # Closed and reopened: the page cache still holds every byte (kernel_cache).
    assert _read_all(path) == data
    again = fs.stats()
    assert again["bytes"] == 8 * MiB
    assert again["requests"] == first["requests"]


def test_stats_file_is_fresh_on_every_read(source: Path, mounted: Mount) -> None:
    (source / "a").write_bytes(b"x" * 10000)
    (source / "b").write_bytes(b"y" * 5000)
    fs = mounted("local")
    assert fs.stats()["bytes"] == 0
    assert fs.path("a").read_bytes() == b"x" * 10000
    assert fs.stats()["files"]["a"]["bytes"] == 10000
    assert fs.path("b").read_bytes() == b"y" * 5000
    stats = fs.stats()
    assert stats["bytes"] == 15000
    assert set(stats["files"]) == {"a", "b"}


def test_scattered_reads_pay_latency_each(source: Path, mounted: Mount) -> None:
    with (source / "sparse.bin").open("wb") as f:
        f.truncate(64 * MiB)
    fs = mounted(SLOW)
    path = fs.path("sparse.bin")
    offsets = [i * 3 * MiB for i in range(16)]  # 3 MiB apart: beyond the 2 MiB tolerance
    random.Random(0).shuffle(offsets)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead: one request each
        elapsed = 0.0
        for offset in offsets:
            evict(path)
            start = time.monotonic()
            assert os.pread(fd, 4096, offset) == bytes(4096)
            elapsed += time.monotonic() - start
    finally:
        os.close(fd)
    assert elapsed >= 16 * SLOW.latency_s
    assert fs.stats()["files"]["sparse.bin"]["seeks"] >= 16


def test_sequential_read_pays_latency_about_once(source: Path, mounted: Mount) -> None:
    (source / "seq.bin").write_bytes(os.urandom(8 * MiB))
    fs = mounted(SLOW)
    path = fs.path("seq.bin")
    evict(path)
    assert len(_read_all(path)) == 8 * MiB
    counts = fs.stats()["files"]["seq.bin"]
    assert counts["bytes"] == 8 * MiB
    assert 1 <= counts["seeks"] <= 3
    assert counts["requests"] > counts["seeks"]


def test_stream_bandwidth_caps_a_sequential_read(source: Path, mounted: Mount) -> None:
    (source / "big.bin").write_bytes(os.urandom(16 * MiB))
    fs = mounted(SLOW)
    path = fs.path("big.bin")
    evict(path)
    start = time.monotonic()
    assert len(_read_all(path)) == 16 * MiB
    assert time.monotonic() - start >= 0.2  # 16 MiB at 64 MiB/s is 0.25 s


def test_residency_helpers_work_inside_the_mount(source: Path, mounted: Mount) -> None:
    (source / "r.bin").write_bytes(os.urandom(4 * MiB + 123))
    fs = mounted("local")
    path = fs.path("r.bin")
    _read_all(path)
    assert file_residency(path) == (4 * MiB + 123, 4 * MiB + 123)
    evict(path)
    assert file_residency(path) == (0, 4 * MiB + 123)
    _read_all(path)
    assert file_residency(path) == (4 * MiB + 123, 4 * MiB + 123)
    assert fs.stats()["files"]["r.bin"]["bytes"] == 2 * (4 * MiB + 123)


def test_overrides_and_unmount(source: Path, tmp_path: Path) -> None:
    mountpoint = tmp_path / "mnt"
    with mount(source, mountpoint, "cross-region", latency_s=0.001) as fs:
        assert os.path.ismount(mountpoint)
        preset = fs.stats()["preset"]
        assert preset["latency_s"] == 0.001
        assert preset["stream_bytes_per_s"] == 0.24 * 2**30
        held = fs.path(".slowfs-stats").open("rb")  # busy: unmount falls back to lazy
    held.close()
    assert not os.path.ismount(mountpoint)
    with pytest.raises(TypeError, match="unknown preset knobs"), mount(source, mountpoint, bw=1):
        pass
