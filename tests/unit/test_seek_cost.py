"""The seek-cost measurement on real files (seek_cost.py): cold places only, exactly
the bytes it reads, a bounded search, stopped by a request, spread over a mount's small
files where one is too small."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest

from spanwarm.pagecache.residency import PAGE, resident_bytes
from spanwarm.planning.seek_cost import (
    LONG_BYTES,
    MAX_CHECKED,
    MIN_FILE_BYTES,
    MIN_SEEKS,
    SHORT_BYTES,
    SLOT,
    WINDOWS,
    FileFailed,
    MeasureStopped,
    Place,
    measure_seek_cost,
    plan_seek_measurement,
)
from tests.daemon_harness import cold_file

MiB = 2**20
LOSS = 0.005


def _open(path: Path) -> int:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    return fd


def test_it_reads_only_cold_places_and_prices_a_seek(tmp_path: Path) -> None:
    size = MIN_FILE_BYTES + 16 * MiB
    fd = _open(cold_file(tmp_path / "shard.bin", size))
    try:
        os.pread(fd, 8 * MiB, size - 8 * MiB)  # the tail is resident: nothing may use it
        plan = plan_seek_measurement([(fd, size)])
        assert (plan.long_bytes, plan.short_bytes) == (LONG_BYTES, SHORT_BYTES)
        windows = [(plan.long.offset, LONG_BYTES), (plan.short.offset, SHORT_BYTES)]
        for start, length in windows:
            assert start % SLOT == 0
            assert start + length <= size - 8 * MiB
        # No read continues near where another ended: about a slot between any two places.
        places = sorted([*windows, *((at.offset, PAGE) for at in plan.seeks)])
        gaps = [b - (a + n) for (a, n), (b, _) in itertools.pairwise(places)]
        assert min(gaps) >= SLOT - PAGE
        assert len(plan.seeks) >= MIN_SEEKS
        read: list[tuple[int, int, int]] = []
        cost = measure_seek_cost([fd], plan, read=read)
        assert cost.seeks >= MIN_SEEKS
        assert cost.stream_bytes_per_s > 0
        assert 0 < cost.seek_cost < 64 * MiB  # a local disk: far below a network mount
        # It read what it says it read, and nothing else.
        assert read[:2] == [(0, a, a + n) for a, n in windows]
        assert read[2:] == [(0, at.offset, at.offset + PAGE) for at in plan.seeks[: cost.seeks]]
        # Idle page cache on these VMs loses a few pages within seconds (DAMON): a window
        # of MiBs may miss a page or two by now (0.5 %), a single page none.
        for _, start, stop in read:
            kept = resident_bytes(fd, start, stop - start)
            assert kept >= (stop - start) * (1 - LOSS if stop - start > PAGE else 1), (start, kept)
        total = sum(b - a for _, a, b in read)
        cached = resident_bytes(fd, 0, size - 8 * MiB)
        assert total * (1 - LOSS) <= cached <= total  # and nothing else was read
    finally:
        os.close(fd)


def test_a_mounts_small_files_are_measured_together(tmp_path: Path) -> None:
    # A DCP directory of small shards: none holds the windows and eight seeks alone.
    sizes = [20 * MiB, 20 * MiB, 20 * MiB, 20 * MiB, 4 * MiB]
    fds = [_open(cold_file(tmp_path / f"__{i}_0.distcp", n, seed=i)) for i, n in enumerate(sizes)]
    try:
        for fd, size in zip(fds, sizes, strict=True):
            with pytest.raises(MeasureStopped, match="cold places to seek to in 1 files"):
                plan_seek_measurement([(fd, size)])
        os.pread(fds[1], 4 * MiB, 16 * MiB)  # one file's tail is resident: passed over
        plan = plan_seek_measurement(list(zip(fds, sizes, strict=True)))
        assert (plan.long_bytes, plan.short_bytes) == WINDOWS[1]  # the small geometry
        places = [(plan.long, plan.long_bytes), (plan.short, plan.short_bytes)]
        places += [(at, PAGE) for at in plan.seeks]
        assert {at.file for at, _ in places} == {0, 1, 2, 3}  # the 4 MiB file holds none
        assert Place(1, 16 * MiB) not in plan.seeks
        for file in range(len(sizes)):  # a slot between any two places of one file
            mine = sorted((at.offset, n) for at, n in places if at.file == file)
            assert all(b - (a + n) >= SLOT - PAGE for (a, n), (b, _) in itertools.pairwise(mine))
            assert all(a + n <= sizes[file] for a, n in mine)
        read: list[tuple[int, int, int]] = []
        cost = measure_seek_cost(fds, plan, read=read)
        assert cost.seeks >= MIN_SEEKS
        assert 0 < cost.seek_cost < 64 * MiB
        for file, fd in enumerate(fds):  # nothing but those places was read
            mine = sorted(
                [(a, b) for f, a, b in read if f == file] + [(16 * MiB, 20 * MiB)] * (file == 1)
            )
            edges = [0, *(x for a, b in mine for x in (a, b)), sizes[file]]
            for start, stop in zip(edges[::2], edges[1::2], strict=True):
                assert resident_bytes(fd, start, stop - start) == 0
    finally:
        for fd in fds:
            os.close(fd)


def test_pages_warmed_after_planning_are_not_timed_as_storage(tmp_path: Path) -> None:
    fd = _open(cold_file(tmp_path / "shard.bin", MIN_FILE_BYTES + 32 * MiB))
    try:
        plan = plan_seek_measurement([(fd, MIN_FILE_BYTES + 32 * MiB)])
        warmed = [at.offset for at in plan.seeks[::2]]  # someone reads half of them meanwhile
        for at in warmed:
            os.pread(fd, PAGE, at)
        read: list[tuple[int, int, int]] = []
        cost = measure_seek_cost([fd], plan, read=read)
        assert not {a for _, a, _ in read[2:]} & set(warmed)
        assert cost.seeks == len(read) - 2
        os.pread(fd, PAGE, plan.long.offset)  # and the window: not this file again
        with pytest.raises(FileFailed) as failed:
            measure_seek_cost([fd], plan)
        assert (failed.value.index, failed.value.offset) == (0, plan.long.offset)
    finally:
        os.close(fd)


def test_a_sparse_or_warm_file_has_nothing_to_measure(tmp_path: Path) -> None:
    sparse = tmp_path / "sparse.bin"
    with open(sparse, "wb") as f:
        f.truncate(MIN_FILE_BYTES * 2)  # all hole: reads would cost no I/O
    warm = cold_file(tmp_path / "warm.bin", MIN_FILE_BYTES * 2)
    for path in (sparse, warm):
        fd = _open(path)
        try:
            os.pread(fd, MIN_FILE_BYTES * 2, 0)
            with pytest.raises(MeasureStopped) as stopped:
                plan_seek_measurement([(fd, MIN_FILE_BYTES * 2)])
            assert not stopped.value.retry
        finally:
            os.close(fd)


def test_huge_sparse_files_are_searched_a_bounded_amount(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 8 TiB each, with 12 MiB of data near the end and holes all around it: allocation
    # enough to be looked at, and a SEEK_DATA search that could walk terabytes.
    size = 2**43
    fds = []
    for i in range(8):
        with open(tmp_path / f"huge{i}.bin", "wb") as f:
            f.truncate(size)
            f.seek(size - 64 * MiB)
            f.write(os.urandom(12 * MiB))
            f.truncate(size)
        fds.append(_open(tmp_path / f"huge{i}.bin"))
    calls = 0
    lseek = os.lseek

    def counted(fd: int, offset: int, whence: int) -> int:
        nonlocal calls
        calls += 1
        return lseek(fd, offset, whence)

    monkeypatch.setattr(os, "lseek", counted)
    try:
        with pytest.raises(MeasureStopped, match="in 8 files"):
            plan_seek_measurement([(fd, size) for fd in fds])
        # One SEEK_DATA/SEEK_HOLE pair per slot at most, MAX_CHECKED slots in all.
        assert 0 < calls <= 2 * MAX_CHECKED
    finally:
        for fd in fds:
            os.close(fd)


def test_a_file_that_shrinks_under_the_measurement_is_the_one_to_blame(tmp_path: Path) -> None:
    paths = [cold_file(tmp_path / f"f{i}.bin", 40 * MiB, seed=i) for i in range(2)]
    fds = [_open(path) for path in paths]
    try:
        plan = plan_seek_measurement([(fd, 40 * MiB) for fd in fds])
        assert {at.file for at in plan.seeks} == {1}  # the windows fill the first file
        os.truncate(paths[1], 2 * MiB)
        with pytest.raises(FileFailed) as failed:
            measure_seek_cost(fds, plan)
        assert failed.value.index == 1
    finally:
        for fd in fds:
            os.close(fd)


def test_one_file_too_small_for_the_large_windows_takes_the_small_ones(tmp_path: Path) -> None:
    fd = _open(cold_file(tmp_path / "shard.bin", 64 * MiB))
    try:
        plan = plan_seek_measurement([(fd, 64 * MiB)])
        assert (plan.long_bytes, plan.short_bytes) == WINDOWS[1]
        assert len(plan.seeks) >= MIN_SEEKS
    finally:
        os.close(fd)


def test_a_request_stops_it_between_reads(tmp_path: Path) -> None:
    fd = _open(cold_file(tmp_path / "shard.bin", MIN_FILE_BYTES))
    asked: list[bool] = []

    def busy() -> bool:
        asked.append(True)
        return len(asked) > 1  # a request arrives during the first window's read

    try:
        plan = plan_seek_measurement([(fd, MIN_FILE_BYTES)])
        with pytest.raises(MeasureStopped) as stopped:
            measure_seek_cost([fd], plan, busy=busy, chunk_bytes=8 * MiB)
        assert stopped.value.retry
        assert resident_bytes(fd, 0, MIN_FILE_BYTES) == 8 * MiB  # one chunk, then nothing
    finally:
        os.close(fd)
