"""WarmEngine against real, evicted files in tmp_path, checked with mincore.

Each test's fd gets FADV_RANDOM so plain reads bring in no neighbours; what is resident
afterwards is what the engine asked for. Residency allows 0.5 % loss (DAMON on the dev VM).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from spanwarm.errors import FileChangedError
from spanwarm.pagecache import warm_engine
from spanwarm.pagecache.memory_map import MADV_POPULATE_READ, madvise, mapped, populate
from spanwarm.pagecache.read_ahead import hint_window
from spanwarm.pagecache.residency import PAGE, evict, resident_bytes
from spanwarm.pagecache.warm_engine import (
    WarmEngine,
    WarmMethod,
    bad_pages,
    default_method,
    populate_supported,
)
from tests.daemon_harness import fuse_file

MiB = 2**20
LOSS = 0.005

METHODS = [
    pytest.param(
        m,
        marks=pytest.mark.skipif(
            m is WarmMethod.POPULATE and not populate_supported(),
            reason="no MADV_POPULATE_READ",
        ),
    )
    for m in WarmMethod
]

ColdFile = Callable[[int], tuple[Path, int]]


@pytest.fixture
def cold_file(tmp_path: Path) -> Iterator[ColdFile]:
    """Make an evicted file of random bytes; returns its path and an open FADV_RANDOM fd."""
    fds: list[int] = []

    def make(size: int) -> tuple[Path, int]:
        path = tmp_path / f"f{len(fds)}.bin"
        with path.open("wb") as f:
            f.write(os.urandom(size))
            f.flush()
            os.fsync(f.fileno())
        evict(path)
        fd = os.open(path, os.O_RDONLY)
        fds.append(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        return path, fd

    yield make
    for fd in fds:
        os.close(fd)


def assert_resident(fd: int, start: int, stop: int) -> None:
    resident = resident_bytes(fd, start, stop - start)
    assert (stop - start) * (1 - LOSS) <= resident <= stop - start


@pytest.mark.parametrize("method", METHODS)
def test_warm_brings_in_the_range_and_not_the_far_bytes(
    cold_file: ColdFile, method: WarmMethod
) -> None:
    _, fd = cold_file(48 * MiB)
    engine = WarmEngine(method)
    start, stop = 5 * PAGE + 7, 12 * MiB + 3  # unaligned, two chunk boundaries inside
    assert engine.warm(fd, [(start, stop)]) == stop - start
    assert engine.bytes_warmed == stop - start
    assert_resident(fd, start, stop)
    assert resident_bytes(fd, 32 * MiB, 16 * MiB) <= 16 * PAGE


@pytest.mark.parametrize("method", METHODS)
def test_small_spans_read_only_their_own_pages(cold_file: ColdFile, method: WarmMethod) -> None:
    # A bare MADV_POPULATE_READ fault reads a read-ahead window around each span (16x
    # more than asked here): the engine must not.
    _, fd = cold_file(32 * MiB)
    spans = [(i * 2 * MiB + 12345, i * 2 * MiB + 12345 + 64 * 1024) for i in range(16)]
    engine = WarmEngine(method)
    wanted = sum(stop - start for start, stop in spans)
    assert engine.warm(fd, spans) == wanted
    for start, stop in spans:
        assert_resident(fd, start, stop)
    # Each unaligned span may bring in the rest of its first and last page, no more.
    assert resident_bytes(fd, 0, 32 * MiB) <= wanted + 2 * PAGE * len(spans)


@pytest.mark.parametrize("method", METHODS)
def test_eight_threads_share_one_engine(cold_file: ColdFile, method: WarmMethod) -> None:
    _, fd = cold_file(64 * MiB)
    engine = WarmEngine(method, chunk_bytes=2 * MiB)
    ranges = [(i * 8 * MiB + 100, i * 8 * MiB + 5 * MiB) for i in range(8)]
    results: list[int] = []
    errors: list[BaseException] = []

    def run(r: tuple[int, int]) -> None:
        try:
            results.append(engine.warm(fd, [r]))
        except BaseException as e:  # surfaced by the asserts below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in ranges]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sorted(results) == sorted(stop - start for start, stop in ranges)
    assert engine.bytes_warmed == sum(results)
    for start, stop in ranges:
        assert_resident(fd, start, stop)
        assert resident_bytes(fd, stop + 2 * MiB, MiB) <= 16 * PAGE  # the gaps stay cold


def test_read_splits_pieces_at_chunk_multiples(
    cold_file: ColdFile, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, fd = cold_file(24 * MiB)
    reads: list[tuple[int, int]] = []
    real_preadv = os.preadv

    def spy(fd_: int, buffers: Any, offset: int, *args: Any) -> int:
        reads.append((offset, len(buffers[0])))
        return real_preadv(fd_, buffers, offset, *args)

    monkeypatch.setattr(os, "preadv", spy)
    engine = WarmEngine(WarmMethod.READ, chunk_bytes=4 * MiB)
    assert engine.warm(fd, [(MiB + 5, 9 * MiB), (20 * MiB, 20 * MiB + 3)]) == 8 * MiB - 2
    assert reads == [
        (MiB + 5, 3 * MiB - 5),
        (4 * MiB, 4 * MiB),
        (8 * MiB, MiB),
        (20 * MiB, 3),
    ]
    assert_resident(fd, MiB + 5, 9 * MiB)


def test_hint_issues_one_willneed_per_piece(
    cold_file: ColdFile, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, fd = cold_file(24 * MiB)
    hints: list[tuple[int, int]] = []
    real_fadvise = os.posix_fadvise

    def spy(fd_: int, offset: int, length: int, advice: int) -> None:
        if advice == os.POSIX_FADV_WILLNEED:
            hints.append((offset, length))
        real_fadvise(fd_, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", spy)
    engine = WarmEngine(WarmMethod.HINT, chunk_bytes=8 * MiB)
    start, stop = 3 * PAGE, 20 * MiB + 5
    assert engine.warm(fd, [(start, stop)]) == stop - start
    assert hints == [(3 * PAGE, 8 * MiB - 3 * PAGE), (8 * MiB, 8 * MiB), (16 * MiB, 4 * MiB + 5)]
    assert_resident(fd, start, stop)


def test_hint_pieces_larger_than_the_read_ahead_window_are_completed(
    cold_file: ColdFile,
) -> None:
    # One WILLNEED reads at most the device read-ahead window (8 MiB here); the rest of
    # a 32 MiB piece is read once residency stops growing.
    _, fd = cold_file(40 * MiB)
    engine = WarmEngine(WarmMethod.HINT, chunk_bytes=32 * MiB)
    assert engine.warm(fd, [(0, 32 * MiB)]) == 32 * MiB
    assert_resident(fd, 0, 32 * MiB)


def test_hint_verifies_by_reading_when_mincore_is_not_trusted(
    cold_file: ColdFile, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, fd = cold_file(8 * MiB)
    monkeypatch.setattr(warm_engine, "residency_trusted", lambda _fd: False)
    reads: list[tuple[int, int]] = []
    real_preadv = os.preadv

    def spy(fd_: int, buffers: Any, offset: int, *args: Any) -> int:
        reads.append((offset, len(buffers[0])))
        return real_preadv(fd_, buffers, offset, *args)

    monkeypatch.setattr(os, "preadv", spy)
    engine = WarmEngine(WarmMethod.HINT, chunk_bytes=2 * MiB)
    assert engine.warm(fd, [(MiB, 5 * MiB)]) == 4 * MiB
    assert reads == [(MiB, MiB), (2 * MiB, 2 * MiB), (4 * MiB, MiB)]
    assert_resident(fd, MiB, 5 * MiB)


@pytest.mark.parametrize("method", METHODS)
def test_a_range_past_the_end_raises_file_changed(cold_file: ColdFile, method: WarmMethod) -> None:
    path, fd = cold_file(4 * MiB + 10)
    engine = WarmEngine(method)
    with pytest.raises(FileChangedError, match=r"f0\.bin") as info:
        engine.warm(fd, [(0, MiB), (4 * MiB, 4 * MiB + 11)])
    assert info.value.path == os.path.realpath(path)
    assert info.value.offset == 4 * MiB + 10
    assert engine.bytes_warmed == 0  # checked before any I/O


@pytest.mark.parametrize("method", METHODS)
def test_a_file_shrinking_while_warming_raises_file_changed(
    cold_file: ColdFile, method: WarmMethod, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Truncate at the engine's first sleep (throttle or residency poll): after the size
    # check, before the second piece.
    path, fd = cold_file(4 * MiB)
    real_sleep = time.sleep
    truncated: list[bool] = []

    def sleep(seconds: float) -> None:
        if not truncated:
            os.truncate(path, MiB)
            truncated.append(True)
        real_sleep(seconds)

    monkeypatch.setattr(time, "sleep", sleep)
    engine = WarmEngine(method, chunk_bytes=MiB, throttle_bytes_per_s=64 * MiB)
    with pytest.raises(FileChangedError, match=r"f0\.bin: file ended at 1048576") as info:
        engine.warm(fd, [(0, 4 * MiB)])
    assert truncated
    assert info.value.offset == MiB


def test_throttle_caps_the_rate_across_threads(cold_file: ColdFile) -> None:
    _, fd = cold_file(8 * MiB)
    engine = WarmEngine(WarmMethod.READ, chunk_bytes=MiB, throttle_bytes_per_s=32 * MiB)
    began = time.monotonic()
    threads = [
        threading.Thread(target=engine.warm, args=(fd, [(i * 4 * MiB, (i + 1) * 4 * MiB)]))
        for i in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # 8 MiB at 32 MiB/s is 0.25 s; only a lower bound (the VM is noisy).
    assert time.monotonic() - began >= 0.2
    assert engine.bytes_warmed == 8 * MiB
    assert_resident(fd, 0, 8 * MiB)


def test_empty_ranges_warm_nothing(cold_file: ColdFile) -> None:
    _, fd = cold_file(MiB)
    engine = WarmEngine(WarmMethod.READ)
    assert engine.warm(fd, []) == 0
    assert engine.warm(fd, [(100, 100), (5 * MiB, 5 * MiB)]) == 0
    assert engine.bytes_warmed == 0
    assert resident_bytes(fd, 0, MiB) == 0


@pytest.mark.parametrize("method", METHODS)
def test_empty_ranges_beside_others_are_passed_over(
    cold_file: ColdFile, method: WarmMethod
) -> None:
    _, fd = cold_file(4 * MiB)
    engine = WarmEngine(method)
    assert engine.warm(fd, [(0, 0), (MiB, 2 * MiB), (3 * MiB + 5, 3 * MiB + 5)]) == MiB
    assert_resident(fd, MiB, 2 * MiB)
    assert resident_bytes(fd, 2 * MiB, 2 * MiB) <= 16 * PAGE


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"chunk_bytes": 0}, "chunk_bytes"),
        ({"chunk_bytes": -PAGE}, "chunk_bytes"),
        ({"chunk_bytes": PAGE + 1}, "chunk_bytes"),
        ({"chunk_bytes": float(PAGE)}, "chunk_bytes"),
        ({"chunk_bytes": True}, "chunk_bytes"),
        ({"throttle_bytes_per_s": 0}, "throttle_bytes_per_s"),
        ({"throttle_bytes_per_s": -1.0}, "throttle_bytes_per_s"),
        ({"throttle_bytes_per_s": float("nan")}, "throttle_bytes_per_s"),
        ({"throttle_bytes_per_s": float("inf")}, "throttle_bytes_per_s"),
    ],
)
def test_bad_arguments_name_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}: "):
        WarmEngine(WarmMethod.READ, **kwargs)


def test_methods_by_name_and_bad_names() -> None:
    assert WarmEngine("hint").method is WarmMethod.HINT  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^method: 'mmap' is not one of populate, read, hint$"):
        WarmEngine("mmap")  # type: ignore[arg-type]


def test_bad_ranges_are_rejected(cold_file: ColdFile) -> None:
    _, fd = cold_file(MiB)
    engine = WarmEngine(WarmMethod.READ)
    with pytest.raises(ValueError, match=r"^ranges: \[10, 5\)"):
        engine.warm(fd, [(0, 10), (10, 5)])
    with pytest.raises(ValueError, match=r"^ranges: \[-1, 5\)"):
        engine.warm(fd, [(-1, 5)])
    assert engine.bytes_warmed == 0


def test_populate_is_the_default_on_linux_5_14_and_later() -> None:
    major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    if (major, minor) < (5, 14):
        pytest.skip("kernel predates MADV_POPULATE_READ")
    assert populate_supported()
    assert default_method() is WarmMethod.POPULATE


@pytest.mark.skipif(not populate_supported(), reason="no MADV_POPULATE_READ")
def test_warming_does_not_follow_read_ahead_marks_other_readers_left(
    cold_file: ColdFile,
) -> None:
    """A rank reading a file's header with read-ahead on leaves PG_readahead marks on
    the pages it read. A bare MADV_POPULATE_READ that faults such a page reads the 8 MiB
    after the range it was asked for; the engine's populate must not (its mapping is
    MADV_RANDOM), nor must pinning a warmed range."""
    path, fd = cold_file(48 * MiB)

    def header_read_then(warm: Callable[[], object]) -> int:
        evict(path)
        plain = os.open(path, os.O_RDONLY)  # the rank's descriptor: read-ahead on
        try:
            os.pread(plain, 8, 0)
            os.pread(plain, 60000, 8)
        finally:
            os.close(plain)
        warm()
        time.sleep(0.2)  # read-ahead the faults began lands meanwhile
        return resident_bytes(fd, 4 * MiB, 44 * MiB)

    def bare_populate() -> None:
        os.posix_fadvise(fd, 0, 4 * MiB, os.POSIX_FADV_WILLNEED)
        with mapped(fd, 0, 4 * MiB) as addr:
            assert madvise(addr, 4 * MiB, MADV_POPULATE_READ) == 0

    followed = header_read_then(bare_populate)
    if followed < MiB:
        pytest.skip(f"no read-ahead past marked pages on this device ({followed} bytes)")
    engine = WarmEngine(WarmMethod.POPULATE)
    assert header_read_then(lambda: engine.warm(fd, [(0, 4 * MiB)])) == 0
    assert_resident(fd, 0, 4 * MiB)

    def warm_then_pin() -> None:
        os.posix_fadvise(fd, 0, 4 * MiB, os.POSIX_FADV_WILLNEED)
        with mapped(fd, 0, 4 * MiB) as addr:
            assert populate(addr, 4 * MiB) == 0

    assert header_read_then(warm_then_pin) == 0


def _populate_cold(path: Path, nbytes: int) -> None:
    """Evict ``path``, then warm its first ``nbytes`` as the daemon does (a descriptor
    with POSIX_FADV_RANDOM, the populate method) and check they are resident."""
    evict(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        assert WarmEngine(WarmMethod.POPULATE).warm(fd, [(0, nbytes)]) == nbytes
        assert_resident(fd, 0, nbytes)
    finally:
        os.close(fd)


@pytest.mark.skipif(not populate_supported(), reason="no MADV_POPULATE_READ")
def test_populate_on_a_mount_with_a_small_window_reads_whole_windows(tmp_path: Path) -> None:
    """The kernel cuts one WILLNEED to the device's window: 128 KiB on a FUSE mount. A
    populate under MADV_RANDOM after it would read the rest of the piece a page at a
    time, 4 KiB per request. The engine lets the kernel's read-ahead stream such a
    piece, on a descriptor made FADV_SEQUENTIAL meanwhile (twice the window a request:
    half as many round trips to the file system's server): nothing before the piece, a
    few windows after it at most, and the descriptor FADV_RANDOM again afterwards."""
    with fuse_file(tmp_path, "f.bin", 16 * MiB) as (fs, path):
        window = fs.read_ahead_kb * 2**10
        assert window < 8 * MiB  # else this mount shows nothing
        assert hint_window(os.stat(path).st_dev) == window
        evict(path)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # as the daemon opens files
            assert WarmEngine(WarmMethod.POPULATE).warm(fd, [(MiB + 100, 9 * MiB)]) == 8 * MiB - 100
            assert_resident(fd, MiB + 100, 9 * MiB)
            time.sleep(0.2)  # read-ahead still in flight lands
            assert resident_bytes(fd, 0, MiB) == 0
            assert resident_bytes(fd, 9 * MiB, 7 * MiB) <= 4 * window
            counts = fs.stats()["files"]["f.bin"]
            # FADV_RANDOM again: two reads in a row read only their bytes, no read-ahead.
            os.pread(fd, 64 * 2**10, 14 * MiB)
            os.pread(fd, 64 * 2**10, 14 * MiB + 64 * 2**10)
            assert fs.stats()["files"]["f.bin"]["bytes"] - counts["bytes"] == 128 * 2**10
        finally:
            os.close(fd)
    assert 8 * MiB <= counts["bytes"] <= 8 * MiB + 4 * window
    assert counts["requests"] <= 8 * MiB // (2 * window) + 4


@pytest.mark.skipif(not populate_supported(), reason="no MADV_POPULATE_READ")
def test_populate_keeps_a_streams_requests_few_and_in_order(tmp_path: Path) -> None:
    """Where a piece spans many windows (FUSE's 128 KiB), hinting all of them at once puts
    one request per window in flight on the piece's descriptor, served in any order: to a
    network file system each out-of-order request is a seek. Hinting 8 windows ahead of
    the populate kept them in order but 9-10 in flight. The kernel's read-ahead, which
    the engine leaves such a piece to, keeps one or two, in order."""
    # A slow stream (8 MiB in 0.25 s), so that requests sent at once are in flight at once.
    with fuse_file(tmp_path, "f.bin", 8 * MiB, stream_bytes_per_s=32 * MiB) as (fs, path):
        assert 8 * MiB // (fs.read_ahead_kb * 2**10) > 16  # else this mount shows nothing
        _populate_cold(path, 8 * MiB)
        stats = fs.stats()
    assert stats["files"]["f.bin"]["bytes"] == 8 * MiB  # the file ends there
    assert stats["files"]["f.bin"]["seeks"] == 1  # the first request only
    assert stats["max_in_flight"] <= 4


def _mappings_of(path: Path) -> int:
    with open("/proc/self/maps") as maps:
        return sum(1 for line in maps if line.rstrip("\n").endswith(str(path)))


@pytest.mark.skipif(not populate_supported(), reason="no MADV_POPULATE_READ")
def test_an_operation_maps_its_range_once_and_leaves_nothing_behind(tmp_path: Path) -> None:
    """The daemon warms an operation piece by piece (to stop between pieces). Each piece
    mapped and unmapped on its own took the process's mmap lock for writing twice, which
    stalls every other worker's populate; an operation maps its range once, streams it
    as one, and unmaps it and sets the descriptor back to FADV_RANDOM at its end, also
    when a piece fails (narrowing the failure down then reads page by page)."""
    from spanwarm.testing.slowfs import Fault

    bad = 7 * MiB + 8192  # past what the first operation's read-ahead reaches
    with fuse_file(tmp_path, "f.bin", 16 * MiB, faults=[Fault("f.bin", bad, PAGE)]) as (fs, path):
        window = fs.read_ahead_kb * 2**10
        evict(path)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # as the daemon opens files
            engine = WarmEngine(WarmMethod.POPULATE)
            with engine.operation(fd, [(MiB, 6 * MiB)]) as operation:
                for start in range(MiB, 6 * MiB, MiB):
                    operation.warm(start, start + MiB)
                    assert _mappings_of(path) == 1
            assert _mappings_of(path) == 0
            assert_resident(fd, MiB, 6 * MiB)
            stream = fs.stats()["files"]["f.bin"]
            with engine.operation(fd, [(7 * MiB, 8 * MiB)]) as operation:
                with pytest.raises(OSError, match="MADV_POPULATE_READ"):  # EFAULT: it says no more
                    operation.warm(7 * MiB, 8 * MiB)
                # FADV_RANDOM again at once: two reads in a row read only their bytes.
                before = fs.stats()["files"]["f.bin"]["bytes"]
                os.pread(fd, 64 * 2**10, 12 * MiB)
                os.pread(fd, 64 * 2**10, 12 * MiB + 64 * 2**10)
                assert fs.stats()["files"]["f.bin"]["bytes"] - before == 128 * 2**10
                assert [(b.start, b.stop) for b in bad_pages(fd, 7 * MiB, 8 * MiB)] == [
                    (bad, bad + PAGE)
                ]
            assert _mappings_of(path) == 0
        finally:
            os.close(fd)
    # Five pieces, one stream: its first request the only seek.
    assert stream["seeks"] == 1
    assert 5 * MiB <= stream["bytes"] <= 5 * MiB + 4 * window
    assert stream["requests"] <= 5 * MiB // (2 * window) + 4
