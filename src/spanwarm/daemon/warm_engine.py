"""The blocking warm primitive: bring byte ranges of an open file into the page cache.

The daemon runs :meth:`WarmEngine.warm` on worker threads. Every call that does I/O or
waits releases the GIL (``os.preadv``, ``os.posix_fadvise``, ctypes ``CDLL`` calls), so the
threads overlap. Ranges are cut into pieces at absolute multiples of ``chunk_bytes``: an
aligned piece spans at most ``chunk_bytes / PAGE`` pages, which is what the kernel's cap on
one WILLNEED call (the device read-ahead window) counts.
"""

from __future__ import annotations

import collections
import enum
import errno
import functools
import math
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from spanwarm.errors import FileChangedError
from spanwarm.memory_map import MADV_POPULATE_READ, madvise, mapped, populate
from spanwarm.read_ahead import hint_window
from spanwarm.residency import PAGE, residency_trusted, resident_bytes

__all__ = [
    "BadRange",
    "WarmEngine",
    "WarmMethod",
    "bad_pages",
    "default_method",
    "populate_supported",
]

# HINT: pieces hinted ahead of the one being confirmed, so the device has a queue.
_HINTS_AHEAD = 4
# HINT: how long to wait for a hinted piece before reading it. A piece larger than the
# device's read-ahead window is only partly read by its hint, so give up early when
# residency stops growing; a pread then waits only for what is missing.
_HINT_WAIT_S = 2.0
_HINT_STALL_S = 0.05
_POLL_MIN_S = 0.001
_POLL_MAX_S = 0.02
# Narrowing a failed range down: past this many failing page reads in one range, the
# rest of it is taken as bad too (the storage is failing wholesale, not a bad sector).
_MAX_FAILED_PAGES = 256


class WarmMethod(enum.StrEnum):
    """How pages are brought in."""

    POPULATE = "populate"  # mmap + MADV_POPULATE_READ: synchronous, no copy to user space
    READ = "read"  # pread into a per-thread buffer: synchronous, works everywhere
    HINT = "hint"  # POSIX_FADV_WILLNEED, then confirm with mincore or a read


@functools.cache
def populate_supported() -> bool:
    """Whether ``madvise(MADV_POPULATE_READ)`` works here (EINVAL before Linux 5.14)."""
    try:
        with mapped(-1, 0, PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) as addr:
            return madvise(addr, PAGE, MADV_POPULATE_READ) == 0
    except OSError:
        return False


def default_method() -> WarmMethod:
    """POPULATE where the kernel has it (least CPU), else READ."""
    return WarmMethod.POPULATE if populate_supported() else WarmMethod.READ


def _fd_name(fd: int) -> str:
    link = f"/proc/self/fd/{fd}"
    try:
        return os.readlink(link)
    except OSError:
        return link


def _past_end(fd: int, offset: int) -> FileChangedError:
    size = os.fstat(fd).st_size
    return FileChangedError(
        _fd_name(fd), f"file ended at {size} bytes while warming", offset=max(offset, size)
    )


class WarmEngine:
    """Warms byte ranges with one :class:`WarmMethod`; safe to share between threads.

    ``throttle_bytes_per_s`` caps the aggregate rate over all threads (a test knob, so
    per-tensor readiness can be observed). ``bytes_warmed`` totals every call.
    """

    def __init__(
        self,
        method: WarmMethod,
        *,
        chunk_bytes: int = 8 * 2**20,
        throttle_bytes_per_s: float | None = None,
    ) -> None:
        try:
            method = WarmMethod(method)
        except ValueError:
            choices = ", ".join(m.value for m in WarmMethod)
            raise ValueError(f"method: {method!r} is not one of {choices}") from None
        if method is WarmMethod.POPULATE and not populate_supported():
            raise ValueError("method: populate needs MADV_POPULATE_READ (Linux 5.14+)")
        if (
            isinstance(chunk_bytes, bool)
            or not isinstance(chunk_bytes, int)
            or chunk_bytes <= 0
            or chunk_bytes % PAGE
        ):
            raise ValueError(
                f"chunk_bytes: must be a positive multiple of the page size {PAGE}, "
                f"got {chunk_bytes!r}"
            )
        if throttle_bytes_per_s is not None and not (
            isinstance(throttle_bytes_per_s, int | float)
            and math.isfinite(throttle_bytes_per_s)
            and throttle_bytes_per_s > 0
        ):
            raise ValueError(
                f"throttle_bytes_per_s: must be a positive number or None, "
                f"got {throttle_bytes_per_s!r}"
            )
        self.method = method
        self.chunk_bytes = chunk_bytes
        self.throttle_bytes_per_s = throttle_bytes_per_s
        self._lock = threading.Lock()
        self._bytes_warmed = 0
        self._next_allowed = 0.0  # monotonic time the throttle lets the next piece start
        self._local = threading.local()

    @property
    def bytes_warmed(self) -> int:
        """Bytes warmed by every call so far."""
        with self._lock:
            return self._bytes_warmed

    def warm(self, fd: int, ranges: Sequence[tuple[int, int]]) -> int:
        """Bring each ``[start, stop)`` of open file ``fd`` into the page cache.

        Returns the bytes warmed (the sum of the range lengths). Raises FileChangedError
        when the file is shorter than a range, before or during the I/O; other OSErrors
        (EIO ...) propagate unchanged. ``fd`` is expected to be ``POSIX_FADV_RANDOM``, as
        the daemon's streams are, and is left so.
        """
        total = 0
        for start, stop in ranges:
            if start < 0 or stop < start:
                raise ValueError(f"ranges: [{start}, {stop}) is not a byte range")
            total += stop - start
        st = os.fstat(fd)
        size = st.st_size
        for start, stop in ranges:
            if stop > size and stop > start:
                raise FileChangedError(
                    _fd_name(fd),
                    f"range [{start}, {stop}) ends past the end of the file ({size} bytes)",
                    offset=max(start, size),
                )
        if self.method is WarmMethod.HINT:
            began = time.perf_counter()
            throttled = self._throttled_s()
            self._warm_hinted(fd, self._pieces(ranges))
            self._add_io(time.perf_counter() - began - (self._throttled_s() - throttled))
        else:
            warm_piece: Callable[[int, int, int], None] = self._read
            if self.method is WarmMethod.POPULATE:
                warm_piece = functools.partial(self._populate, window=hint_window(st.st_dev))
            for off, end in self._pieces(ranges):
                began = time.perf_counter()
                warm_piece(fd, off, end)
                self._add_io(time.perf_counter() - began)
                self._done(end - off)
        return total

    def io_seconds(self) -> float:
        """Seconds this thread has spent in the storage's reads (throttle sleeps excluded)."""
        return float(getattr(self._local, "io_s", 0.0))

    def _add_io(self, seconds: float) -> None:
        self._local.io_s = self.io_seconds() + seconds

    def _throttled_s(self) -> float:
        return float(getattr(self._local, "throttled_s", 0.0))

    def _pieces(self, ranges: Sequence[tuple[int, int]]) -> Iterator[tuple[int, int]]:
        chunk = self.chunk_bytes
        for start, stop in ranges:
            off = start
            while off < stop:
                end = min(stop, (off // chunk + 1) * chunk)
                yield off, end
                off = end

    def _done(self, nbytes: int) -> None:
        """Count a finished piece, then sleep as long as the throttle asks."""
        rate = self.throttle_bytes_per_s
        wait = 0.0
        with self._lock:
            self._bytes_warmed += nbytes
            if rate is not None:
                now = time.monotonic()
                self._next_allowed = max(self._next_allowed, now) + nbytes / rate
                wait = self._next_allowed - now
        if wait > 0:
            time.sleep(wait)
            self._local.throttled_s = self._throttled_s() + wait

    def _populate(self, fd: int, off: int, end: int, *, window: int) -> None:
        # One hint first (the kernel cuts a WILLNEED to the device's ``window``: 8 MiB on
        # this VM's disk, 128 KiB on FUSE). Where it covers the piece, the populate runs
        # under MADV_RANDOM (memory_map.populate): a fault's read-around would read a
        # window around it, and a page carrying a read-ahead mark another reader left
        # the 8-16 MiB after it, bytes nobody asked for. Where the window is smaller than
        # the piece, the kernel's read-ahead streams it: faults with read-around and
        # asynchronous read-ahead, a window or two in flight, in order, with the
        # descriptor FADV_SEQUENTIAL meanwhile (which doubles its window: on FUSE 256 KiB
        # requests, half as many, each a round trip through the file system's server;
        # the daemon alone warmed the emulated mounts' node plan 20% sooner). That reads
        # at most 2-3 of the device's windows past each run (1-2% more bytes on the
        # emulated mounts). Hinting the windows here instead was slower on the emulated
        # cross-region mount, measured: 8 ahead of the populate, 2-5% slower loads and
        # ranks reading 10-50 tensors themselves instead of 1-2; a streamed front and
        # the last two windows exact, the daemon alone 12% slower; all windows at once,
        # 64 requests of one descriptor served out of order, seeks (1.7x the time).
        start = off - off % PAGE
        length = end - start
        if end - off <= window:
            # From the first page on, in pieces of the window: an unaligned piece of a
            # window's bytes spans a page more, which one hint's cut would leave out.
            for at in range(start, end, window):
                os.posix_fadvise(fd, at, min(window, end - at), os.POSIX_FADV_WILLNEED)
            with mapped(fd, start, length) as addr:
                err = populate(addr, length)
        else:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            try:
                os.posix_fadvise(fd, off, end - off, os.POSIX_FADV_WILLNEED)
                with mapped(fd, start, length) as addr:
                    err = madvise(addr, length, MADV_POPULATE_READ)
            finally:  # back to the caller's FADV_RANDOM (NORMAL first resets the window)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_NORMAL)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        if err == errno.EFAULT and os.fstat(fd).st_size < end:
            raise _past_end(fd, off)  # the page past EOF would have been a SIGBUS
        if err:
            raise OSError(err, f"madvise(MADV_POPULATE_READ): {os.strerror(err)}")

    def _read(self, fd: int, off: int, end: int) -> None:
        buf: memoryview | None = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = memoryview(bytearray(self.chunk_bytes))
        while off < end:
            got = os.preadv(fd, [buf[: end - off]], off)
            if got == 0:
                raise _past_end(fd, off)
            off += got

    def _warm_hinted(self, fd: int, pieces: Iterator[tuple[int, int]]) -> None:
        trusted = residency_trusted(fd)
        hinted: collections.deque[tuple[int, int]] = collections.deque()
        for off, end in pieces:
            os.posix_fadvise(fd, off, end - off, os.POSIX_FADV_WILLNEED)
            hinted.append((off, end))
            if len(hinted) > _HINTS_AHEAD:
                self._confirm(fd, *hinted.popleft(), trusted=trusted)
        while hinted:
            self._confirm(fd, *hinted.popleft(), trusted=trusted)

    def _confirm(self, fd: int, off: int, end: int, *, trusted: bool) -> None:
        """Wait for a hinted piece to be resident; read it when mincore cannot tell or stalls."""
        if trusted and self._wait_resident(fd, off, end):
            self._done(end - off)
            return
        # A read of cached pages is a memcpy; it blocks only on pages not yet in.
        self._read(fd, off, end)
        self._done(end - off)

    @staticmethod
    def _wait_resident(fd: int, off: int, end: int) -> bool:
        length = end - off
        now = time.monotonic()
        deadline = now + _HINT_WAIT_S
        last, last_progress = -1, now
        delay = _POLL_MIN_S
        while True:
            resident = resident_bytes(fd, off, length)
            if resident == length:
                return True
            now = time.monotonic()
            if resident > last:
                last, last_progress = resident, now
            if now >= deadline or now - last_progress >= _HINT_STALL_S:
                return False
            time.sleep(delay)
            delay = min(delay * 2, _POLL_MAX_S)


@dataclass(frozen=True, slots=True)
class BadRange:
    """Bytes ``[start, stop)`` the storage failed to read, and the errno it gave."""

    start: int
    stop: int
    errno: int

    @property
    def cause(self) -> str:
        return os.strerror(self.errno)


def bad_pages(fd: int, start: int, stop: int) -> list[BadRange]:
    """Find the pages of ``[start, stop)`` that fail to read, with ``pread``.

    Called after a warm operation failed: good pages are read in large pieces (and so
    end up in the page cache), a read that fails is retried page by page from where it
    failed, so a 64 KiB bad range costs 16 failing reads and the rest of the range is
    warmed. Adjacent bad pages with the same errno come back as one range; an empty list
    means the failure did not repeat.
    """
    buf = memoryview(bytearray(min(stop - start, 1 << 20) or 1))
    bad: list[BadRange] = []
    failed = 0
    off = start
    while off < stop:
        try:
            got = os.preadv(fd, [buf[: min(len(buf), stop - off)]], off)
        except OSError as exc:
            page_end = min(stop, (off // PAGE + 1) * PAGE)
            code = exc.errno or errno.EIO
            failed += 1
            if failed >= _MAX_FAILED_PAGES:
                page_end = stop
            if bad and bad[-1].stop == off and bad[-1].errno == code:
                bad[-1] = BadRange(bad[-1].start, page_end, code)
            else:
                bad.append(BadRange(off, page_end, code))
            off = page_end
            continue
        if got == 0:
            raise _past_end(fd, off)
        off += got
    return bad
