"""The seek-cost measurement on real files (seek_cost.py): cold places only, exactly
the bytes it names, stopped by a request."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest

from spanwarm.residency import PAGE, resident_bytes
from spanwarm.seek_cost import (
    LONG_BYTES,
    MIN_FILE_BYTES,
    MIN_SEEKS,
    SHORT_BYTES,
    SLOT,
    MeasureStopped,
    measure_seek_cost,
    plan_seek_measurement,
)
from tests.daemon_harness import cold_file

MiB = 2**20


def _open(path: Path) -> int:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    return fd


def test_it_reads_only_cold_places_and_prices_a_seek(tmp_path: Path) -> None:
    size = MIN_FILE_BYTES + 16 * MiB
    fd = _open(cold_file(tmp_path / "shard.bin", size))
    try:
        os.pread(fd, 8 * MiB, size - 8 * MiB)  # the tail is resident: nothing may use it
        plan = plan_seek_measurement(fd, size)
        windows = [(plan.long_at, LONG_BYTES), (plan.short_at, SHORT_BYTES)]
        for start, length in windows:
            assert start % SLOT == 0
            assert start + length <= size - 8 * MiB
        # No read continues near where another ended: about a slot between any two places.
        places = sorted([*windows, *((at, PAGE) for at in plan.seeks)])
        gaps = [b - (a + n) for (a, n), (b, _) in itertools.pairwise(places)]
        assert min(gaps) >= SLOT - PAGE
        assert len(plan.seeks) >= MIN_SEEKS
        cost = measure_seek_cost(fd, plan)
        assert cost.seeks >= MIN_SEEKS
        assert cost.stream_bytes_per_s > 0
        assert cost.seek_cost == int(cost.seek_s * cost.stream_bytes_per_s)
        assert 0 < cost.seek_cost < 64 * MiB  # a local disk: far below a network mount
        # It read what it named: both windows whole, one page per seek, nothing else.
        read = sum(resident_bytes(fd, a, b - a) for a, b in plan.ranges[:2])
        assert read == LONG_BYTES + SHORT_BYTES
        pages = [resident_bytes(fd, at, PAGE) for at in plan.seeks]
        assert pages == [PAGE] * cost.seeks + [0] * (len(plan.seeks) - cost.seeks)
        assert resident_bytes(fd, 0, size - 8 * MiB) == read + cost.seeks * PAGE
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
                plan_seek_measurement(fd, MIN_FILE_BYTES * 2)
            assert not stopped.value.retry
        finally:
            os.close(fd)


def test_a_request_stops_it_between_reads(tmp_path: Path) -> None:
    fd = _open(cold_file(tmp_path / "shard.bin", MIN_FILE_BYTES))
    asked: list[bool] = []

    def busy() -> bool:
        asked.append(True)
        return len(asked) > 1  # a request arrives after the first read

    try:
        plan = plan_seek_measurement(fd, MIN_FILE_BYTES)
        with pytest.raises(MeasureStopped) as stopped:
            measure_seek_cost(fd, plan, busy=busy)
        assert stopped.value.retry
        assert resident_bytes(fd, 0, MIN_FILE_BYTES) == LONG_BYTES  # the first read only
    finally:
        os.close(fd)
