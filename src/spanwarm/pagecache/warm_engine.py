"""The blocking warm primitive: bring byte ranges of an open file into the page cache.

The daemon runs :meth:`WarmEngine.warm` on worker threads. Every call that does I/O or
waits releases the GIL (``os.preadv``, ``os.posix_fadvise``, ctypes ``CDLL`` calls), so the
threads overlap. Ranges are cut into pieces at absolute multiples of ``chunk_bytes``: an
aligned piece spans at most ``chunk_bytes / PAGE`` pages, which is what the kernel's cap on
one WILLNEED call (the device read-ahead window) counts.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import errno
import functools
import math
import mmap
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from spanwarm.errors import FileChangedError
from spanwarm.pagecache.memory_map import MADV_POPULATE_READ, madvise, map_range, mapped, unmap
from spanwarm.pagecache.read_ahead import hint_window
from spanwarm.pagecache.residency import PAGE, residency_trusted, resident_bytes

__all__ = [
    "BadRange",
    "WarmEngine",
    "WarmMethod",
    "WarmOperation",
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
        if not total:
            return 0
        with self.operation(fd, ranges) as operation:
            for start, stop in ranges:
                operation.check(start, stop)
            for start, stop in ranges:
                if stop > start:
                    operation.warm(start, stop)
        return total

    @contextlib.contextmanager
    def operation(self, fd: int, ranges: Sequence[tuple[int, int]]) -> Iterator[WarmOperation]:
        """One warm operation on ``fd`` (``POSIX_FADV_RANDOM``, left so) of ``ranges``, its
        pieces within their hull (empty ranges count nowhere): what the pieces share (the
        file's size and device window; for populate, one mapping and the descriptor's
        advice) is set up once, not per piece."""
        lo = min((a for a, b in ranges if b > a), default=0)
        hi = max((b for a, b in ranges if b > a), default=lo)
        operation = WarmOperation(self, fd, lo, hi)
        try:
            yield operation
        finally:
            operation.close()

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


class WarmOperation:
    """The pieces of one warm operation (:meth:`WarmEngine.operation`), warmed in order.

    With populate, a piece longer than the device's read-ahead window (FUSE's 128 KiB)
    is streamed by the kernel's read-ahead, with the descriptor ``POSIX_FADV_SEQUENTIAL``
    for the rest of the operation, and a shorter one is read exactly, under
    ``MADV_RANDOM`` (see :meth:`_populate`). Each kind has one mapping of the operation's
    range, made on its first piece: an mmap and a munmap per piece take the process's
    mmap lock for writing twice a piece, stalling every other worker's populate, and
    advice set and reset per piece costs four calls; without them (and without a mapping
    for each piece's residency check) the daemon alone warms the emulated cross-region
    mount's node plan 3.6% sooner.
    """

    def __init__(self, engine: WarmEngine, fd: int, lo: int, hi: int) -> None:
        st = os.fstat(fd)
        self.engine, self.fd, self.size = engine, fd, st.st_size
        self.window = hint_window(st.st_dev)
        self._base = lo - lo % PAGE
        self._length = max(hi - self._base, PAGE)
        self._maps: dict[bool, int] = {}  # streamed? -> address of the operation's mapping
        self._sequential = False  # the descriptor is FADV_SEQUENTIAL until close
        self._streamed_to = -1  # where the last streamed piece ended

    def check(self, start: int, stop: int) -> None:
        """Raise FileChangedError where ``[start, stop)`` ends past the file's end."""
        if stop > self.size and stop > start:
            raise FileChangedError(
                _fd_name(self.fd),
                f"range [{start}, {stop}) ends past the end of the file ({self.size} bytes)",
                offset=max(start, self.size),
            )

    def warm(self, start: int, stop: int) -> None:
        """Warm ``[start, stop)`` (inside the operation's range), cut at multiples of the
        engine's chunk. On an error the descriptor is ``POSIX_FADV_RANDOM`` again, for
        :func:`bad_pages` to narrow the failure down page by page."""
        if not self._base <= start <= stop <= self._base + self._length:
            raise ValueError(f"[{start}, {stop}) is outside the operation's range")
        self.check(start, stop)
        engine = self.engine
        pieces = engine._pieces([(start, stop)])
        if engine.method is WarmMethod.HINT:
            began = time.perf_counter()
            throttled = engine._throttled_s()
            engine._warm_hinted(self.fd, pieces)
            engine._add_io(time.perf_counter() - began - (engine._throttled_s() - throttled))
            return
        try:
            for off, end in pieces:
                began = time.perf_counter()
                if engine.method is WarmMethod.POPULATE:
                    self._populate(off, end)
                else:
                    engine._read(self.fd, off, end)
                engine._add_io(time.perf_counter() - began)
                engine._done(end - off)
        except BaseException:
            self._random()
            raise

    def close(self) -> None:
        for addr in self._maps.values():
            unmap(addr, self._length)
        self._maps.clear()
        self._random()

    def _random(self) -> None:
        """Back to the caller's FADV_RANDOM (NORMAL first resets the window)."""
        if self._sequential:
            self._sequential = False
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_NORMAL)
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)

    def _mapping(self, streamed: bool) -> int:
        addr = self._maps.get(streamed)
        if addr is None:
            addr = map_range(self.fd, self._base, self._length)
            if not streamed:
                madvise(addr, self._length, mmap.MADV_RANDOM)
            self._maps[streamed] = addr
        return addr

    def _populate(self, off: int, end: int) -> None:
        # One hint first (the kernel cuts a WILLNEED to the device's ``window``: 8 MiB on
        # this VM's disk, 128 KiB on FUSE). Where it covers the piece, the populate runs
        # under MADV_RANDOM: a fault's read-around would read a window around it, and a
        # page carrying a read-ahead mark another reader left the 8-16 MiB after it,
        # bytes nobody asked for. Where the window is smaller than the piece, the
        # kernel's read-ahead streams it: faults with read-around and asynchronous
        # read-ahead, a window or two in flight, in order, with the descriptor
        # FADV_SEQUENTIAL meanwhile (which doubles its window: on FUSE 256 KiB requests,
        # half as many, each a round trip through the file system's server; the daemon
        # alone warms the emulated mounts' node plan 20% sooner). That reads at most
        # 2-3 of the device's windows past each run (1-2% more bytes on the emulated
        # mounts). Hinting the windows here is slower on the emulated cross-region
        # mount, measured: 8 ahead of the populate, 2-5% slower loads and
        # ranks reading 10-50 tensors themselves instead of 1-2; a streamed front and
        # the last two windows exact, the daemon alone 12% slower; all windows at once,
        # 64 requests of one descriptor served out of order, seeks (1.7x the time).
        fd, window = self.fd, self.window
        start = off - off % PAGE
        length = end - start
        streamed = end - off > window
        if not streamed:
            # From the first page on, in pieces of the window: an unaligned piece of a
            # window's bytes spans a page more, which one hint's cut would leave out.
            for at in range(start, end, window):
                os.posix_fadvise(fd, at, min(window, end - at), os.POSIX_FADV_WILLNEED)
        else:
            if not self._sequential:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                self._sequential = True
            if off != self._streamed_to:  # else the stream's read-ahead is ahead already
                os.posix_fadvise(fd, off, end - off, os.POSIX_FADV_WILLNEED)
            self._streamed_to = end
        addr = self._mapping(streamed) + (start - self._base)
        err = madvise(addr, length, MADV_POPULATE_READ)
        if err == errno.EFAULT and os.fstat(fd).st_size < end:
            raise _past_end(fd, off)  # the page past EOF would have been a SIGBUS
        if err:
            raise OSError(err, f"madvise(MADV_POPULATE_READ): {os.strerror(err)}")


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
