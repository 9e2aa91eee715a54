"""One warm operation (Warmer): against the in-memory page cache, and the kernel's on a
real evicted file checked with mincore."""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import pytest

from spanwarm.daemon.files import OpenFile
from spanwarm.daemon.page_cache import KernelPageCache, MemoryPageCache
from spanwarm.daemon.warming import MIN_PIECE, Warmer
from spanwarm.errors import FileChangedError
from spanwarm.pagecache.residency import PAGE, evict, resident_bytes
from spanwarm.pagecache.warm_engine import BadRange, WarmEngine, default_method

CHUNK = 8 * 2**20
PIECE = CHUNK // 8


@dataclass(frozen=True)
class _File:
    path: str


def _file(path: str = "f") -> OpenFile:
    """A stand-in for an open file: the in-memory page cache only hashes it."""
    return cast(OpenFile, _File(path))


def _never() -> bool:
    return False


def test_it_reads_what_is_not_resident_in_pieces_and_records_each() -> None:
    cache, file = MemoryPageCache(), _file()
    cache.resident_ranges[file] = [(0, PIECE)]  # the first piece is in already
    outcome = Warmer(cache, CHUNK).warm(file, [(0, 3 * PIECE)], _never)
    assert [(s, e) for _, s, e in cache.reads] == [(PIECE, 2 * PIECE), (2 * PIECE, 3 * PIECE)]
    assert outcome.read == 2 * PIECE
    assert outcome.verified == PIECE
    assert outcome.covered == [(0, PIECE), (PIECE, 2 * PIECE), (2 * PIECE, 3 * PIECE)]
    assert outcome.fetched == [(PIECE, 2 * PIECE), (2 * PIECE, 3 * PIECE)]
    times = [t for _, _, t in outcome.pieces]
    assert times == sorted(times)
    assert outcome.done >= times[-1]


def test_all_resident_is_one_look_and_no_session() -> None:
    cache, file = MemoryPageCache(), _file()
    cache.resident_ranges[file] = [(0, CHUNK)]
    outcome = Warmer(cache, CHUNK).warm(file, [(0, PAGE), (CHUNK - PAGE, CHUNK)], _never)
    assert cache.reads == []
    assert outcome.read == 0
    assert outcome.verified == 2 * PAGE


def test_untrusted_residency_is_read_anyway() -> None:
    cache, file = MemoryPageCache(), _file()
    cache.resident_ranges[file] = [(0, CHUNK)]
    cache.untrusted.add(file)
    outcome = Warmer(cache, CHUNK).warm(file, [(0, PIECE)], _never)
    assert outcome.read == PIECE
    assert len(cache.reads) == 1


def test_it_stops_between_pieces_when_asked_after_the_first() -> None:
    cache, file = MemoryPageCache(), _file()
    asked = []

    def stop() -> bool:
        asked.append(len(cache.reads))
        return True

    outcome = Warmer(cache, CHUNK).warm(file, [(0, 4 * PIECE)], stop)
    assert asked == [1]
    assert outcome.covered == [(0, PIECE)]


def test_bad_pages_fail_alone_and_the_rest_is_warm() -> None:
    cache, file = MemoryPageCache(), _file()
    cache.bad[file] = [(PIECE + PAGE, PIECE + 3 * PAGE)]
    outcome = Warmer(cache, CHUNK).warm(file, [(0, 2 * PIECE)], _never)
    assert outcome.bad == [BadRange(PIECE + PAGE, PIECE + 3 * PAGE, errno.EIO)]
    good = [(a, b) for a, b, _ in outcome.good()]
    assert good == [(0, PIECE), (PIECE, PIECE + PAGE), (PIECE + 3 * PAGE, 2 * PIECE)]
    assert cache.resident(file, 0, 2 * PIECE) == 2 * PIECE - 2 * PAGE


def test_a_file_changed_while_warming_fails_the_operation() -> None:
    cache, file = MemoryPageCache(), _file()

    def replace(f: object, start: int, stop: int) -> None:
        if start >= PIECE:
            cache.changed.add(file)

    cache.on_read = replace
    with pytest.raises(FileChangedError):
        Warmer(cache, CHUNK).warm(file, [(0, 2 * PIECE)], _never)


def test_slow_pieces_halve_down_to_the_minimum() -> None:
    cache, file = MemoryPageCache(), _file()
    ticks = iter(range(0, 10_000))
    warmer = Warmer(cache, CHUNK, clock=lambda: float(next(ticks)))  # every piece takes 1 s
    warmer.warm(file, [(0, 4 * PIECE)], _never)
    sizes = [e - s for _, s, e in cache.reads]
    assert sizes[:4] == [PIECE, PIECE // 2, PIECE // 4, PIECE // 8]
    assert min(sizes) == MIN_PIECE
    assert sum(sizes) == 4 * PIECE


def test_hold_pins_the_good_ranges() -> None:
    cache, file = MemoryPageCache(), _file()
    cache.resident_ranges[file] = [(0, PIECE)]  # resident: still pinned (not the one look)
    outcome = Warmer(cache, CHUNK, hold=True).warm(file, [(0, PIECE)], _never)
    assert outcome.kept == [(0, PIECE)]


def test_cold_reads_are_learned_and_resident_ones_are_not() -> None:
    cache, file = MemoryPageCache(), _file()
    cache.resident_ranges[file] = [(PIECE, PIECE + PAGE)]  # partly resident: not a cold read
    learned: list[tuple[object, int, float]] = []
    warmer = Warmer(cache, CHUNK, on_cold_read=lambda f, n, s: learned.append((f, n, s)))
    warmer.warm(file, [(0, 2 * PIECE)], _never)
    assert learned == [(file, PIECE, cache.read_seconds)]


def test_the_kernel_page_cache_warms_a_real_file(tmp_path: Path) -> None:
    from spanwarm.daemon.files import FileTable

    path = tmp_path / "data"
    path.write_bytes(os.urandom(4 * 2**20))
    files = FileTable(())
    file, _ = files.acquire(str(path))
    try:
        evict(path)
        warmer = Warmer(KernelPageCache(WarmEngine(default_method(), chunk_bytes=2**20)), 2**20)
        outcome = warmer.warm(file, [(PAGE, 3 * 2**20)], _never)
        got = resident_bytes(file.fd, PAGE, 3 * 2**20 - PAGE)
        assert got >= 0.995 * (3 * 2**20 - PAGE)
        assert outcome.read + outcome.verified == 3 * 2**20 - PAGE
        assert outcome.covered[0][0] == PAGE
        assert outcome.covered[-1][1] == 3 * 2**20
        again = warmer.warm(file, [(PAGE, 3 * 2**20)], _never)
        assert again.read == 0
        assert again.verified == 3 * 2**20 - PAGE
    finally:
        files.close_all()
