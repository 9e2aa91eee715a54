"""The seek-cost probe on real files (daemon/seek_probe.py): calibrate's measurement in
small, on cold windows only, stopped by a request."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from spanwarm.daemon.admission import FileIdentity, OpenFile
from spanwarm.daemon.seek_probe import (
    CONTIGUOUS_BYTES,
    MIN_PROBE_FILE_BYTES,
    ProbeStopped,
    cold_windows,
    probe_seek_cost,
)
from spanwarm.residency import resident_bytes
from tests.daemon_harness import cold_file

MiB = 2**20


def _open(path: Path) -> OpenFile:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    return OpenFile(str(path), fd, FileIdentity.of(os.fstat(fd)))


def test_the_probe_reads_two_cold_windows_and_prices_a_seek(tmp_path: Path) -> None:
    path = cold_file(tmp_path / "shard.bin", MIN_PROBE_FILE_BYTES + 16 * MiB)
    file = _open(path)
    try:
        last = file.size - 8 * MiB
        os.pread(file.fd, 8 * MiB, last)  # the tail is resident: no window may include it
        windows = cold_windows(file.fd, file.size)
        assert len(windows) == 2
        for start in windows:
            assert start % (8 * MiB) == 0
            assert start + CONTIGUOUS_BYTES <= last
            assert resident_bytes(file.fd, start, CONTIGUOUS_BYTES) == 0
        probe = probe_seek_cost(file.stream, windows, busy=lambda: False)
        assert probe.spans >= 64
        assert probe.stream_bytes_per_s > 0
        assert probe.seek_cost == int(probe.per_span_s * probe.stream_bytes_per_s)
        assert 0 < probe.seek_cost < 64 * MiB  # a local disk: far below a network mount
        # What it read is what it says: the first window whole, 16 KiB every 128 KiB of
        # the second, and nothing of the rest.
        assert resident_bytes(file.fd, windows[0], CONTIGUOUS_BYTES) == CONTIGUOUS_BYTES
        spans_read = resident_bytes(file.fd, windows[1], CONTIGUOUS_BYTES)
        assert spans_read == probe.spans * 16 * 1024
        assert resident_bytes(file.fd, 0, windows[1]) == 0
    finally:
        os.close(file.fd)


def test_a_sparse_or_warm_file_has_no_window_to_probe(tmp_path: Path) -> None:
    sparse = tmp_path / "sparse.bin"
    with open(sparse, "wb") as f:
        f.truncate(MIN_PROBE_FILE_BYTES + 16 * MiB)  # all hole: reads would cost no I/O
    fd = os.open(sparse, os.O_RDONLY)
    try:
        assert cold_windows(fd, os.fstat(fd).st_size) == []
    finally:
        os.close(fd)
    warm = cold_file(tmp_path / "warm.bin", MIN_PROBE_FILE_BYTES)
    fd = os.open(warm, os.O_RDONLY)
    try:
        os.pread(fd, MIN_PROBE_FILE_BYTES, 0)
        assert cold_windows(fd, MIN_PROBE_FILE_BYTES) == []
        with pytest.raises(ProbeStopped) as stopped:
            probe_seek_cost(lambda: None, [], busy=lambda: False)  # type: ignore[arg-type,return-value]
        assert not stopped.value.retry
    finally:
        os.close(fd)


def test_a_request_stops_the_probe_between_cells(tmp_path: Path) -> None:
    path = cold_file(tmp_path / "shard.bin", MIN_PROBE_FILE_BYTES)
    file = _open(path)
    asked = []

    def busy() -> bool:
        asked.append(True)
        return len(asked) > 2  # a request arrives after two cells

    try:
        windows = cold_windows(file.fd, file.size)
        with pytest.raises(ProbeStopped) as stopped:
            probe_seek_cost(file.stream, windows, busy=busy)
        assert stopped.value.retry
        read = sum(resident_bytes(file.fd, w, CONTIGUOUS_BYTES) for w in windows)
        assert read == 2 * 8 * MiB  # two cells, then nothing more
    finally:
        os.close(file.fd)
