"""Each mount's seek cost, probed by the daemon once per mount while no request is live.

``spanwarm calibrate`` is how an operator measures a mount's seek cost by hand; the daemon
takes the same measurement (:mod:`spanwarm.seek_cost`: one stream's sequential rate from
a short and a long contiguous read, times the time of one seek from single pages 4 MiB
apart) on a file a request named, so nobody has to. Its reads during a load cannot give
the figure: with eight operations in flight, the fixed cost of each is mostly queueing.

So once per mount (:class:`SeekProber`), when no request has been live for two ticks,
it takes the largest file (``MIN_FILE_BYTES`` or more) a request named on a mount with
no figure yet, and measures on places of it that are cold and allocated, through a fresh
descriptor of its own, alone, on a thread at a lower CPU priority. A request arriving
stops it between reads; the mount is probed at the next idle moment. What it read is
dropped from the page cache afterwards, unless a live request names the file by then.
A probe that does not return (hung storage) is given up after ``PROBE_TIMEOUT_S``, and
its mount is not probed again until the daemon restarts (after ``MAX_STUCK`` such, no
mount is). A file that gives no figure (nothing cold to measure, having been read whole
by the load, say; or failing, or changing under the probe) leaves its mount to the next
large file a request names. The figure is kept with the
mount's throughput (``devices.json``), so a mount is probed once, not once per daemon
start; ``--seek-cost`` overrides it, and then nothing is probed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from spanwarm.daemon.admission import FileIdentity, OpenFile
from spanwarm.daemon.threads import DaemonThreadPool
from spanwarm.daemon.throughput import StreamThroughput
from spanwarm.seek_cost import (
    MIN_FILE_BYTES,
    MeasureStopped,
    SeekCost,
    measure_seek_cost,
    plan_seek_measurement,
)

__all__ = ["SeekProber"]

logger = logging.getLogger("spanwarm.daemon")

PROBE_TIMEOUT_S = 120.0  # a probe still running then is stuck in the storage
IDLE_TICKS = 2  # ticks with no live request before a probe starts
MAX_CANDIDATES = 32  # mounts waiting for a probe, each holding one descriptor
MAX_STUCK = 4  # probes lost in hung storage before probing stops until a restart
MAX_TRIED = 4096  # files remembered as having given no figure


@dataclass
class _Candidate:
    file: OpenFile  # a descriptor of its own (a dup): the request's may close first
    mount: str
    read: list[tuple[int, int]] = field(default_factory=list)  # what the probe may read
    started: float = 0.0
    future: Future[SeekCost] | None = None


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
        self._done: set[str] = set()  # probed, or given up on, this run
        self._tried: set[FileIdentity] = set()  # files that gave no figure: not again
        self._stuck = 0  # probes that never returned: their threads are lost
        self._idle_ticks = 0
        self._pool = DaemonThreadPool(1, "spanwarm-probe", nice=10)

    def offer(self, file: OpenFile) -> None:
        """A request names ``file``: its mount is probed on it, if on none larger, and if
        the mount's seek cost is not known yet (and mincore can be believed there: the
        windows must be found cold)."""
        if file.size < MIN_FILE_BYTES or not file.trusted or file.failed:
            return
        if file.identity in self._tried or self._stuck >= MAX_STUCK:
            return
        mount = self._learned.name(file.identity.device)
        if mount in self._done or self._learned.seek_cost(file.identity.device):
            return
        if self._running is not None and self._running.mount == mount:
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
        self._waiting[mount] = _Candidate(copy, mount)

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
                self._stuck += 1
                self._pool.grow_to(self._stuck + 1)
                running.future.add_done_callback(lambda _: self._close(running.file.fd))
            return
        self._idle_ticks = self._idle_ticks + 1 if idle else 0
        if self._idle_ticks < IDLE_TICKS or not self._waiting or self._stuck >= MAX_STUCK:
            return
        mount, candidate = next(iter(self._waiting.items()))
        del self._waiting[mount]
        candidate.started = time.monotonic()
        candidate.future = self._pool.submit(self._probe, candidate, busy)
        self._running = candidate

    def _probe(self, candidate: _Candidate, busy: Callable[[], bool]) -> SeekCost:
        """In the probe's thread: find the places (mincore may fault pages in from a slow
        mount), then measure through one fresh descriptor."""
        file = candidate.file
        with file.stream() as fd:
            plan = plan_seek_measurement(fd, file.size)
            candidate.read = plan.ranges
            return measure_seek_cost(fd, plan, busy=busy, chunk_bytes=self._chunk)

    def _finish(self, candidate: _Candidate, wanted: Callable[[FileIdentity], bool]) -> None:
        self._running = None
        file = candidate.file
        assert candidate.future is not None
        try:
            result = candidate.future.result()
        except MeasureStopped as exc:
            if exc.retry:  # a request came: the mount waits for the next idle moment
                self._waiting.setdefault(candidate.mount, candidate)
            else:  # nothing cold here (a file read whole, say): another file may do
                logger.info("seek cost of %s not probed on %s: %s", candidate.mount, file.path, exc)
                self._try_elsewhere(file)
        except Exception as exc:  # a failing or changing file: another file may do
            logger.warning(
                "seek cost probe of %s on %s failed: %s", candidate.mount, file.path, exc
            )
            self._try_elsewhere(file)
        else:
            self._learned.learn_seek_cost(file.identity.device, result.seek_cost)
            self._done.add(candidate.mount)
            offered = self._waiting.pop(candidate.mount, None)  # while this one ran
            if offered is not None:
                self._close(offered.file.fd)
            logger.info(
                "seek cost of %s: %d bytes (probed on %s: %.2f ms per seek over %d seeks, "
                "one stream %.1f MiB/s)",
                candidate.mount,
                result.seek_cost,
                file.path,
                result.seek_s * 1e3,
                result.seeks,
                result.stream_bytes_per_s / 2**20,
            )
        if not wanted(file.identity):  # what the probe read, nobody asked for
            with contextlib.suppress(OSError):
                for start, stop in candidate.read:
                    os.posix_fadvise(file.fd, start, stop - start, os.POSIX_FADV_DONTNEED)
        candidate.read = []
        if self._waiting.get(candidate.mount) is not candidate:
            self._close(file.fd)

    def _try_elsewhere(self, file: OpenFile) -> None:
        """Not this file again (a user's file that fails, or changes under the probe, must
        not keep its mount from being probed on another one)."""
        if len(self._tried) >= MAX_TRIED:
            self._tried.clear()
        self._tried.add(file.identity)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        running = self._running
        if running is not None and running.future is not None:
            running.future.add_done_callback(lambda _: self._close(running.file.fd))
        self._running = None
        for candidate in self._waiting.values():
            self._close(candidate.file.fd)
        self._waiting.clear()
