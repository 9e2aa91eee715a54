"""A mount's seek cost, measured the way ``spanwarm calibrate`` does, in small.

``spanwarm calibrate`` reads 12.5% of a file as spans of 16 KiB .. 64 MiB with one worker
and fits ``t = t0 + spans x c``; the seek cost is ``c`` times the whole-file throughput
``S`` of that one stream. The daemon's own reads during a load cannot give that figure:
with eight operations in flight the fixed cost of each is mostly queueing (fitted on
this machine's disk: 1 MiB, where calibrate measures 28 KiB).

So once per mount (:class:`SeekProber`), when no request is live, the daemon probes the
largest file of that mount a request named, alone, with calibrate's geometry and its
reads (a fresh descriptor per 8 MiB cell, ``POSIX_FADV_RANDOM``, ``pread``):

1. ``S``: a cold, allocated window of ``CONTIGUOUS_BYTES`` read whole, cell by cell;
2. ``c``: another cold window read as 16 KiB spans every 128 KiB (12.5%), a cell at a
   time until ``SPAN_SECONDS`` have passed (at least ``MIN_SPANS`` spans, at most the
   window): ``c = (t - bytes / S) / spans``, the smallest point of calibrate's fit less
   the time its bytes take to stream;
3. both windows are dropped from the page cache again, unless a live request names the
   file by then (it may want them).

Windows are whole cells that no page of is resident (a read would measure memory) and
that hold no hole (a sparse file would read zeros without any I/O). The probe stops
between cells as soon as a request arrives, and is tried again at the next idle moment:
it never competes with a load. A probe that does not return (hung storage) is given up
after ``PROBE_TIMEOUT_S``, and its mount is not probed again until the daemon restarts.
The figure is kept with the mount's throughput (``devices.json``), so a mount is probed
once, not once per daemon start; ``--seek-cost`` overrides it, and then nothing is probed.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import AbstractContextManager
from dataclasses import dataclass

from spanwarm.daemon.admission import FileIdentity, OpenFile
from spanwarm.daemon.threads import DaemonThreadPool
from spanwarm.daemon.throughput import StreamThroughput
from spanwarm.daemon.warm_engine import WarmEngine, WarmMethod
from spanwarm.residency import resident_bytes

__all__ = [
    "CONTIGUOUS_BYTES",
    "MIN_PROBE_FILE_BYTES",
    "SPAN_BYTES",
    "ProbeStopped",
    "SeekProbe",
    "SeekProber",
    "cold_windows",
    "probe_seek_cost",
]

logger = logging.getLogger("spanwarm.daemon")

CELL = 8 << 20  # calibrate's operation: one descriptor per 8 MiB cell
CONTIGUOUS_BYTES = 32 << 20  # read whole for S
SPAN_BYTES = 16 << 10  # calibrate's smallest span size
SPAN_STEP = 128 << 10  # 12.5%, calibrate's fraction
SPAN_WINDOW = 32 << 20  # at most 256 spans
SPAN_SECONDS = 0.5  # enough spans to outweigh timer and scheduling noise
MIN_SPANS = CELL // SPAN_STEP  # one cell's worth: 64
MAX_SEEK_COST = 1 << 30  # past this a figure is a damaged measurement, not a mount
MIN_PROBE_FILE_BYTES = 2 * CONTIGUOUS_BYTES + CELL  # two windows, whatever the alignment
PROBE_TIMEOUT_S = 120.0  # a probe still running then is stuck in the storage
IDLE_TICKS = 2  # ticks with no live request before a probe starts
MAX_CANDIDATES = 32  # mounts waiting for a probe, each holding one descriptor


class ProbeStopped(Exception):
    """The file cannot be probed (``retry`` False), or a request arrived (``retry`` True:
    the mount is probed at the next idle moment)."""

    def __init__(self, reason: str, *, retry: bool = False) -> None:
        super().__init__(reason)
        self.retry = retry


@dataclass(frozen=True)
class SeekProbe:
    seek_cost: int
    """Bytes one seek costs: ``per_span_s`` x ``stream_bytes_per_s``."""
    per_span_s: float
    stream_bytes_per_s: float
    spans: int


def cold_windows(fd: int, size: int, want: int = CONTIGUOUS_BYTES, count: int = 2) -> list[int]:
    """Offsets of up to ``count`` cell-aligned windows of ``want`` bytes with no resident
    page and no hole, from the end of the file back (a load reads from the front)."""
    found: list[int] = []
    start = (size - want) // CELL * CELL
    while start >= 0 and len(found) < count:
        if resident_bytes(fd, start, want) == 0 and _all_data(fd, start, start + want):
            found.append(start)
            start -= want
        else:
            start -= CELL
    return found


def _all_data(fd: int, start: int, stop: int) -> bool:
    """No hole in ``[start, stop)``: reads there reach the storage."""
    try:
        data = os.lseek(fd, start, os.SEEK_DATA)
        return data == start and os.lseek(fd, start, os.SEEK_HOLE) >= stop
    except OSError as exc:  # ENXIO: nothing but hole from here on
        # Anything else: no SEEK_HOLE here (some FUSE mounts), so the file is all data.
        return exc.errno != errno.ENXIO


def probe_seek_cost(
    stream: Callable[[], AbstractContextManager[int]],
    windows: list[int],
    *,
    busy: Callable[[], bool],
    chunk_bytes: int = CELL,
) -> SeekProbe:
    """Measure the seek cost by reading, through fresh descriptors from ``stream()``, the
    two cold windows ``windows`` (from :func:`cold_windows`): the first whole, the second
    as spans. Raises :class:`ProbeStopped` when ``busy()`` turns true between cells. The
    caller drops the windows from the page cache afterwards, however it ends."""
    if len(windows) < 2:
        raise ProbeStopped(f"no two cold {CONTIGUOUS_BYTES >> 20} MiB windows")
    whole_at, spans_at = windows[:2]
    engine = WarmEngine(WarmMethod.READ, chunk_bytes=chunk_bytes)
    seconds = 0.0
    for cell in range(whole_at, whole_at + CONTIGUOUS_BYTES, CELL):
        seconds += _timed(engine, stream, [(cell, cell + CELL)], busy)
    stream_rate = CONTIGUOUS_BYTES / seconds
    spans, seconds = 0, 0.0
    for cell in range(spans_at, spans_at + SPAN_WINDOW, CELL):
        ranges = [(a, a + SPAN_BYTES) for a in range(cell, cell + CELL, SPAN_STEP)]
        seconds += _timed(engine, stream, ranges, busy)
        spans += len(ranges)
        if spans >= MIN_SPANS and seconds >= SPAN_SECONDS:
            break
    per_span = max(0.0, (seconds - spans * SPAN_BYTES / stream_rate) / spans)
    seek_cost = min(MAX_SEEK_COST, int(per_span * stream_rate))
    return SeekProbe(seek_cost, per_span, stream_rate, spans)


def _timed(
    engine: WarmEngine,
    stream: Callable[[], AbstractContextManager[int]],
    ranges: list[tuple[int, int]],
    busy: Callable[[], bool],
) -> float:
    """One of calibrate's operations: a fresh descriptor, ``ranges`` read; seconds."""
    if busy():
        raise ProbeStopped("a request arrived", retry=True)
    started = time.perf_counter()
    with stream() as fd:
        engine.warm(fd, ranges)
    return time.perf_counter() - started


@dataclass
class _Candidate:
    file: OpenFile  # a descriptor of its own (a dup): the request's may close first
    mount: str
    windows: list[int]
    started: float = 0.0
    future: Future[SeekProbe] | None = None


class SeekProber:
    """Which mounts still need a seek cost, and the one probe running at a time.

    Driven from the event loop: :meth:`offer` as requests arrive, :meth:`tick` once a
    second. The probe itself runs on a thread of its own (at a lower CPU priority).
    """

    def __init__(
        self, learned: StreamThroughput, *, chunk: int, close: Callable[[int], object] = os.close
    ) -> None:
        self._learned = learned
        self._chunk = chunk
        self._close = close
        self._waiting: dict[str, _Candidate] = {}  # mount -> the file to probe it on
        self._running: _Candidate | None = None
        self._done: set[str] = set()  # probed, given up, or found no cold windows this run
        self._idle_ticks = 0
        self._pool = DaemonThreadPool(1, "spanwarm-probe", nice=10)

    def offer(self, file: OpenFile) -> None:
        """A request names ``file``: its mount is probed on it, if on none larger, and if
        the mount's seek cost is not known yet (and mincore can be believed there: the
        windows must be found cold)."""
        if file.size < MIN_PROBE_FILE_BYTES or not file.trusted or file.failed:
            return
        mount = self._learned.name(file.identity.device)
        if mount in self._done or self._learned.seek_cost(file.identity.device):
            return
        known = self._waiting.get(mount)
        if known is not None and known.file.size >= file.size:
            return
        if known is None and len(self._waiting) >= MAX_CANDIDATES:
            return
        try:
            copy = OpenFile(file.path, os.dup(file.fd), file.identity)
        except OSError:  # out of descriptors: the mount waits for another request
            return
        if known is not None:
            self._close(known.file.fd)
        self._waiting[mount] = _Candidate(copy, mount, [])

    def tick(
        self, *, idle: bool, busy: Callable[[], bool], wanted: Callable[[FileIdentity], bool]
    ) -> None:
        """Once a second, on the loop. ``idle``: no live request; ``busy()`` is asked from
        the probe's thread between cells; ``wanted(identity)``: a live request names that
        file (then what the probe read stays in the page cache)."""
        running = self._running
        if running is not None and running.future is not None:
            if running.future.done():
                self._finish(running, wanted)
            elif time.monotonic() - running.started > PROBE_TIMEOUT_S:
                logger.warning(
                    "seek cost probe of %s has not returned in %.0f s: %s is not probed again",
                    running.file.path,
                    PROBE_TIMEOUT_S,
                    running.mount,
                )
                self._done.add(running.mount)
                self._running = None  # its thread is lost; a new one takes the next probe
                self._pool.grow_to(2)
                running.future.add_done_callback(lambda _: self._close(running.file.fd))
            return
        self._idle_ticks = self._idle_ticks + 1 if idle else 0
        if self._idle_ticks < IDLE_TICKS or not self._waiting:
            return
        mount, candidate = next(iter(self._waiting.items()))
        del self._waiting[mount]
        candidate.started = time.monotonic()
        candidate.future = self._pool.submit(self._probe, candidate, busy)
        self._running = candidate

    def _probe(self, candidate: _Candidate, busy: Callable[[], bool]) -> SeekProbe:
        """In the probe's thread: find the windows (mincore may fault pages in from a slow
        mount), then measure."""
        file = candidate.file
        candidate.windows = cold_windows(file.fd, file.size)
        return probe_seek_cost(file.stream, candidate.windows, busy=busy, chunk_bytes=self._chunk)

    def _finish(self, candidate: _Candidate, wanted: Callable[[FileIdentity], bool]) -> None:
        self._running = None
        file = candidate.file
        assert candidate.future is not None
        try:
            result = candidate.future.result()
        except ProbeStopped as exc:
            if exc.retry:  # a request came: the mount waits for the next idle moment
                self._waiting.setdefault(candidate.mount, candidate)
            else:
                logger.info("seek cost of %s not probed on %s: %s", candidate.mount, file.path, exc)
                self._done.add(candidate.mount)
        except Exception as exc:  # a failing file: the mount is not probed again this run
            logger.warning(
                "seek cost probe of %s on %s failed: %s", candidate.mount, file.path, exc
            )
            self._done.add(candidate.mount)
        else:
            self._learned.learn_seek_cost(file.identity.device, result.seek_cost)
            self._done.add(candidate.mount)
            logger.info(
                "seek cost of %s: %d bytes (probed on %s: %.2f ms per span over %d spans, "
                "one stream %.1f MiB/s)",
                candidate.mount,
                result.seek_cost,
                file.path,
                result.per_span_s * 1e3,
                result.spans,
                result.stream_bytes_per_s / 2**20,
            )
        if not wanted(file.identity):  # what the probe read, nobody asked for
            for start in candidate.windows:
                os.posix_fadvise(file.fd, start, CONTIGUOUS_BYTES, os.POSIX_FADV_DONTNEED)
        candidate.windows = []
        if self._waiting.get(candidate.mount) is not candidate:
            self._close(file.fd)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        running = self._running
        if running is not None and running.future is not None:
            running.future.add_done_callback(lambda _: self._close(running.file.fd))
        self._running = None
        for candidate in self._waiting.values():
            self._close(candidate.file.fd)
        self._waiting.clear()
