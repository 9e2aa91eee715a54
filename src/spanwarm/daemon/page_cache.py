"""What a warm operation needs from the page cache, and two page caches that give it.

:class:`KernelPageCache` is the daemon's: the file's own stream (``OpenFile.stream``), the
:class:`~spanwarm.pagecache.warm_engine.WarmEngine`'s reads, ``cachestat``/``mincore`` where
they tell the truth, ``pread`` page by page to find bad pages, and ``--hold``'s mappings.
:class:`MemoryPageCache` keeps residency as byte ranges in memory, with pages that fail
and files that change on demand: the warm operation and the node above it are tested
with it alone, with no storage and no kernel in the way.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Protocol

from spanwarm.daemon.files import OpenFile
from spanwarm.daemon.ranges import Range, clip, subtract, total, union
from spanwarm.errors import FileChangedError
from spanwarm.pagecache.memory_map import map_range, populate, unmap
from spanwarm.pagecache.residency import PAGE, resident_bytes
from spanwarm.pagecache.warm_engine import BadRange, WarmEngine, bad_pages

__all__ = ["FileSession", "KernelPageCache", "MemoryPageCache", "PageCache"]

logger = logging.getLogger("spanwarm.daemon")


class FileSession(Protocol):
    """One warm operation's access to one file (``PageCache.session``)."""

    def resident(self, start: int, stop: int) -> int:
        """Bytes of ``[start, stop)`` in the page cache now (pages being read count)."""

    def warm(self, start: int, stop: int) -> float:
        """Bring ``[start, stop)`` in; the seconds spent reading storage. Raises
        FileChangedError when the file changed, OSError when the storage fails."""

    def bad_pages(self, start: int, stop: int) -> list[BadRange]:
        """After a failed ``warm``: the pages that fail, the others read in."""

    def check_in_place(self) -> None:
        """Raise FileChangedError if the file was replaced, deleted or moved out."""

    def pin(self, ranges: list[Range]) -> list[tuple[int, int]]:
        """Keep warmed ``ranges`` mapped (``--hold``): the mappings, or none."""


class PageCache(Protocol):
    def trusted(self, file: OpenFile) -> bool:
        """Whether residency of ``file`` may be believed (mincore tells this daemon the
        truth for it)."""

    def all_resident(self, file: OpenFile, ranges: list[Range]) -> bool:
        """Every byte of ``ranges`` (their envelope) resident, and the file unchanged."""

    def session(self, file: OpenFile, ranges: list[Range]) -> AbstractContextManager[FileSession]:
        """Access to ``file`` for one operation on ``ranges``."""

    def unpin(self, address: int, length: int) -> None:
        """Give back one of ``FileSession.pin``'s mappings."""


class KernelPageCache:
    """The kernel's page cache, read through the warm engine."""

    def __init__(self, engine: WarmEngine) -> None:
        self.engine = engine

    def trusted(self, file: OpenFile) -> bool:
        return file.trusted

    def all_resident(self, file: OpenFile, ranges: list[Range]) -> bool:
        lo, hi = min(a for a, _ in ranges), max(b for _, b in ranges)
        if resident_bytes(file.fd, lo, hi - lo) != hi - lo:
            return False
        file.check_in_place()
        return True

    @contextlib.contextmanager
    def session(self, file: OpenFile, ranges: list[Range]) -> Iterator[FileSession]:
        with file.stream() as fd, self.engine.operation(fd, ranges) as operation:
            yield _KernelSession(self.engine, file, fd, operation.warm)

    def unpin(self, address: int, length: int) -> None:
        unmap(address, length)


class _KernelSession:
    def __init__(
        self, engine: WarmEngine, file: OpenFile, fd: int, warm: Callable[[int, int], None]
    ) -> None:
        self._engine, self._file, self._fd, self._warm = engine, file, fd, warm

    def resident(self, start: int, stop: int) -> int:
        return resident_bytes(self._fd, start, stop - start, counted=True)

    def warm(self, start: int, stop: int) -> float:
        before = self._engine.io_seconds()
        self._warm(start, stop)
        return self._engine.io_seconds() - before

    def bad_pages(self, start: int, stop: int) -> list[BadRange]:
        return bad_pages(self._fd, start, stop)

    def check_in_place(self) -> None:
        self._file.check_in_place(self._fd)

    def pin(self, ranges: list[Range]) -> list[tuple[int, int]]:
        """Map each range and fault it in (it is resident: no I/O): mapped pages are not
        reclaimed while the mapping lives. All or none: a mapping that fails (ENOMEM at
        vm.max_map_count) gives back the ones made before it; the bytes are warm either way."""
        kept: list[tuple[int, int]] = []
        try:
            for start, stop in ranges:
                base = start - start % PAGE
                addr = map_range(self._fd, base, stop - base)
                kept.append((addr, stop - base))
                populate(addr, stop - base)
        except OSError as exc:
            logger.warning("--hold: cannot keep a warmed range mapped: %s", exc)
            for addr, length in kept:
                unmap(addr, length)
            return []
        return kept


class MemoryPageCache:
    """A page cache in memory: per file, the resident byte ranges (whole pages).

    ``bad`` (per file: pages whose reads fail with EIO), ``changed`` (files replaced under
    the daemon) and ``untrusted`` (files whose residency may not be believed) are set by a
    test; ``reads`` lists every range read from "storage", in order; ``on_read`` runs
    before each read (a test blocks it to hold an operation in flight).
    """

    def __init__(self) -> None:
        self.resident_ranges: dict[OpenFile, list[Range]] = {}
        self.bad: dict[OpenFile, list[Range]] = {}
        self.changed: set[OpenFile] = set()
        self.untrusted: set[OpenFile] = set()
        self.reads: list[tuple[OpenFile, int, int]] = []
        self.on_read: Callable[[OpenFile, int, int], None] = lambda file, start, stop: None
        self.read_seconds = 0.001
        self.unpinned: list[tuple[int, int]] = []
        self._lock = threading.Lock()

    def resident(self, file: OpenFile, start: int, stop: int) -> int:
        with self._lock:
            return total(clip(self.resident_ranges.get(file, ()), start, stop))

    def evict(self, file: OpenFile) -> None:
        with self._lock:
            self.resident_ranges.pop(file, None)

    def trusted(self, file: OpenFile) -> bool:
        return file not in self.untrusted

    def all_resident(self, file: OpenFile, ranges: list[Range]) -> bool:
        lo, hi = min(a for a, _ in ranges), max(b for _, b in ranges)
        if self.resident(file, lo, hi) != hi - lo:
            return False
        self._check(file)
        return True

    @contextlib.contextmanager
    def session(self, file: OpenFile, ranges: list[Range]) -> Iterator[FileSession]:
        self._check(file)
        yield _MemorySession(self, file)

    def unpin(self, address: int, length: int) -> None:
        self.unpinned.append((address, length))

    def _check(self, file: OpenFile) -> None:
        if file in self.changed:
            raise FileChangedError(file.path, "replaced while warming")

    def _read(self, file: OpenFile, start: int, stop: int) -> float:
        self.on_read(file, start, stop)
        self._check(file)
        lo, hi = start - start % PAGE, -(-stop // PAGE) * PAGE
        with self._lock:
            self.reads.append((file, start, stop))
            failing = clip(self.bad.get(file, ()), lo, hi)
            good = subtract([(lo, hi)], union(failing))
            self.resident_ranges[file] = union([*self.resident_ranges.get(file, ()), *good])
        if failing:
            raise OSError(errno.EIO, "Input/output error")
        return self.read_seconds


class _MemorySession:
    def __init__(self, cache: MemoryPageCache, file: OpenFile) -> None:
        self._cache, self._file = cache, file

    def resident(self, start: int, stop: int) -> int:
        return self._cache.resident(self._file, start, stop)

    def warm(self, start: int, stop: int) -> float:
        return self._cache._read(self._file, start, stop)

    def bad_pages(self, start: int, stop: int) -> list[BadRange]:
        failing = clip(union(self._cache.bad.get(self._file, ())), start, stop)
        return [BadRange(a, b, errno.EIO) for a, b in failing]

    def check_in_place(self) -> None:
        self._cache._check(self._file)

    def pin(self, ranges: list[Range]) -> list[tuple[int, int]]:
        return [(a, b - a) for a, b in ranges]  # nothing to map: the "address" is the offset
