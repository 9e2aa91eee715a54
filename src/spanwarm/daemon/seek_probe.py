"""Each mount's seek cost, probed by the daemon while no request is live.

``spanwarm calibrate`` is how an operator measures a mount's seek cost by hand; the daemon
takes the same measurement (:mod:`spanwarm.planning.seek_cost`: one stream's sequential rate from
a short and a long contiguous read, times the time of one seek from single pages 4 MiB
apart) on a file a request named, so nobody has to. Its reads during a load cannot give
the figure: with eight operations in flight, the fixed cost of each is mostly queueing.

So (:class:`SeekProber`), when no request has been live for two ticks, it takes the
files a request named on a mount with no figure yet, or one older than ``MAX_AGE_S`` (the
``MAX_PER_MOUNT`` largest, ``MIN_PLACE_BYTES`` or more each), and measures on places of
them that are cold and allocated: the windows in the largest files with room for them,
the seeks wherever they are left (one large shard, or a DCP directory of small ones).
Each file is read through a fresh descriptor of its own, alone, on a thread at a lower
CPU priority. A request arriving stops the probe between reads; the mount is probed at
the next idle moment. What it read is dropped from the page cache afterwards, unless a
live request names the file by then.

What a user can do to it: files that give no figure (nothing cold left, having been
read whole by the load, say) leave their mount to the next files a request names, and a
file that fails or changes under the probe is left out of the next try; neither is tried
again; after ``MAX_FAILED_PER_UID`` such files named by one user's requests, that user's
files are not offered any more, and one user's requests hold at most
``MAX_WAITING_PER_UID`` of the waiting files. A probe that does not return (hung
storage, a user's own FUSE server) is given up after ``PROBE_TIMEOUT_S``: its mount is
not probed again until the daemon restarts, and a user whose requests named
``MAX_STUCK_PER_UID`` such files gets no more probes of its files (the thread of each is
lost; the file it was opening, looking at, reading or closing is the one to blame, and
nobody when it was stuck before touching any). Places are checked cold again just
before each read, so pages warmed meanwhile are not timed as storage; a figure is
re-measured after ``MAX_AGE_S``, and deleting the mount's entry from ``devices.json``
(daemon stopped) or ``--seek-cost`` replaces it.

No live request does not mean an idle device: a job loading without spanwarm, or writing
its checkpoint, may read the mount meanwhile, and a probe it slows down prices every
later load there (one such probe on this machine's disk measured 88 MB/s for a stream
that gets 800, and for a week ranks waited several times longer than reading the tensor
themselves took). So a probe is **disturbed**, and not kept, when others read the block
device meanwhile at over a quarter of the lone stream the probe measured
(``/sys/dev/block/MAJ:MIN/stat``; network and FUSE mounts have none), or when its lone
stream came out below 0.8 of one of the daemon's own streams, which share the mount
with seven others. The mount is probed again at its next idle moment, up to
``MAX_DISTURBED`` probes a run; then the least disturbed figure (the fastest lone
stream) is kept. A kept figure below the daemon's own
streams (an older daemon's, or one whose mount has since got faster) is probed again,
within the same bound.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import time
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field

from spanwarm.daemon.files import OpenFile
from spanwarm.daemon.threads import DaemonThreadPool
from spanwarm.daemon.throughput import StreamThroughput, mount_name
from spanwarm.errors import FileChangedError
from spanwarm.planning.seek_cost import (
    MIN_PLACE_BYTES,
    FileFailed,
    MeasureStopped,
    SeekCost,
    measure_seek_cost,
    plan_seek_measurement,
)

__all__ = ["MAX_AGE_S", "SeekProber"]

logger = logging.getLogger("spanwarm.daemon")

PROBE_TIMEOUT_S = 120.0  # a probe still running then is stuck in the storage
IDLE_TICKS = 2  # ticks with no live request before a probe starts
MAX_AGE_S = 7 * 86400.0  # a figure older than a week is measured again
MAX_CANDIDATES = 32  # files waiting for a probe, each holding one descriptor
MAX_PER_MOUNT = 8  # the largest files of a mount: probed together
CANDIDATE_TTL_S = 600.0  # a candidate not probed by then lets its descriptor go
MAX_STUCK_PER_UID = 2  # probes of a user's files lost in hung storage: no more for it
MAX_FAILED_PER_UID = 16  # a user's files that gave no figure: no more for it
MAX_WAITING_PER_UID = 8  # files of one user's requests waiting: others' get room too
MAX_TRIED = 4096  # files remembered as having given no figure
MAX_DISTURBED = 4  # probes of one mount in a run, disturbed or re-probed, at most
# After the n-th disturbed probe the mount waits this many seconds x 2^(n-1) (whatever else
# reads the storage may go on for a while: a load without spanwarm, a checkpoint save).
DISTURBED_BACKOFF_S = 30.0
# Others' reads of the device while the probe runs disturb it when they are more than
# this many bytes (file system metadata, an idle system's trickle) and, per second of the
# probe, more than this share of the lone stream it measured: a reader at 25 MB/s beside
# a probe of an 800 MB/s disk is not one, a load beside it is.
FOREIGN_SLACK_BYTES = 4 << 20
FOREIGN_SHARE = 0.25


@dataclass
class _Candidate:
    file: OpenFile  # a descriptor of its own (a dup): the request's may close first
    mount: str
    uid: int  # whose request named it
    offered: float = field(default_factory=time.monotonic)


@dataclass
class _Probe:
    """One mount's files, measured together on the probe's thread."""

    files: list[_Candidate]
    future: Future[_Measured] = field(init=False)
    started: float = field(default_factory=time.monotonic)
    # (file index, start, stop), appended by the thread before each read: what it read.
    read: list[tuple[int, int, int]] = field(default_factory=list)
    # The file the thread is looking at, opening, reading or closing (set before each):
    # the one a stuck call is in. None before it touched any.
    touching: int | None = None


@dataclass(frozen=True)
class _Measured:
    cost: SeekCost
    seconds: float  # how long the measurement took
    foreign_bytes: int | None  # what else the block device read meanwhile (None: no counter)


def device_read_bytes(device: int) -> int | None:
    """Bytes the block device ``device`` (an ``st_dev``) has read since boot, from its
    sysfs counter; None for a device with none (NFS, FUSE, overlay, btrfs subvolumes)."""
    try:
        with open(f"/sys/dev/block/{os.major(device)}:{os.minor(device)}/stat", "rb") as f:
            fields = f.read(4096).split()
        return int(fields[2]) * 512  # sectors read, in 512-byte units whatever the device's
    except (OSError, IndexError, ValueError):
        return None


def _key(item: OpenFile | _Candidate) -> tuple[int, int]:
    """A file by (st_dev, st_ino): the same file whatever its size and mtime now."""
    identity = item.file.identity if isinstance(item, _Candidate) else item.identity
    return identity.device, identity.inode


class SeekProber:
    """Which mounts still need a seek cost, and the one probe running at a time.

    Driven from the event loop: :meth:`offer` as requests arrive, :meth:`tick` once a
    second. The probe itself runs on a thread of its own (at a lower CPU priority), and
    touches nothing of this object but its :class:`_Probe`'s ``read`` and ``touching``.
    """

    def __init__(
        self,
        learned: StreamThroughput,
        *,
        chunk: int,
        close: Callable[[int, Hashable], object] = lambda fd, lane: os.close(fd),
    ) -> None:
        self._learned = learned
        self._chunk = chunk
        self._close = close
        self._waiting: list[_Candidate] = []  # largest first
        self._running: _Probe | None = None
        self._done: set[str] = set()  # probed, or given up on, this run
        self._tried: set[tuple[int, int]] = set()  # (st_dev, st_ino) that gave no figure
        self._stuck: collections.Counter[int] = collections.Counter()  # per uid
        self._failed: collections.Counter[int] = collections.Counter()  # per uid
        self._idle_ticks = 0
        self._lost = 0  # threads given up with their probe
        # Per mount, this run: probes that ended with a figure, disturbed or not (bounds
        # both the retries of a disturbed probe and re-probes of a figure found below the
        # daemon's own streams; a figure a week old starts the count again).
        self._probed: collections.Counter[str] = collections.Counter()
        self._not_before: dict[str, float] = {}  # per mount: no probe before (monotonic)
        # Per mount: the fastest of this run's disturbed probes (device, figure, files).
        self._least_disturbed: dict[str, tuple[int, SeekCost, str]] = {}
        self._pool = DaemonThreadPool(1, "spanwarm-probe", nice=10)

    def due(self, mount: str) -> bool:
        """Whether ``mount`` is to be probed at the next idle moment a request of it
        leaves: it has no figure yet, an old one, or a disturbed one (not past
        ``MAX_DISTURBED`` probes this run); False once its probe was given up."""
        if mount in self._done:
            return False
        age = self._learned.seek_cost_age(mount)
        if age is None or age > MAX_AGE_S:
            return True
        return self._probed[mount] < MAX_DISTURBED and self._learned.probe_disturbed(mount)

    def offer(self, file: OpenFile, uid: int) -> None:
        """A request of ``uid`` names ``file``: kept to probe its mount on, if the mount
        needs a figure, among its ``MAX_PER_MOUNT`` largest files (and if mincore can be
        believed there: the places must be found cold)."""
        if file.size < MIN_PLACE_BYTES or not file.trusted or file.failed:
            return
        if self._stuck[uid] >= MAX_STUCK_PER_UID or self._failed[uid] >= MAX_FAILED_PER_UID:
            return
        if _key(file) in self._tried:
            return
        mount = self._learned.name(file.identity.device)
        if not self.due(mount):
            return
        running = [] if self._running is None else self._running.files
        held = [*self._waiting, *running]  # a probe's files come back if a request stops it
        if any(_key(c) == _key(file) for c in held):
            return
        # Full (per mount, per user, or in all): a larger file takes the place of the
        # smallest waiting one of the mount's, or else of the user's own; never of another
        # user's files on other mounts.
        same = [c for c in self._waiting if c.mount == mount]
        own = [c for c in self._waiting if c.uid == uid]
        if sum(c.mount == mount for c in held) >= MAX_PER_MOUNT:
            pool: list[_Candidate] | None = same
        elif sum(c.uid == uid for c in held) >= MAX_WAITING_PER_UID:
            pool = own
        elif len(held) >= MAX_CANDIDATES:
            pool = own or same
        else:
            pool = None
        smallest = None if pool is None else min(pool, key=lambda c: c.file.size, default=None)
        if pool is not None and (smallest is None or smallest.file.size >= file.size):
            return
        try:
            fd = os.dup(file.fd)
        except OSError:  # out of descriptors: the mount waits for another request
            return
        if smallest is not None:
            self._drop(smallest)
        self._waiting.append(_Candidate(OpenFile.copy_of(file, fd), mount, uid))
        self._waiting.sort(key=lambda c: -c.file.size)

    def tick(self, *, idle: bool, busy: Callable[[], bool]) -> None:
        """Once a second, on the loop. ``idle``: no live request; ``busy()`` is asked from
        the probe's thread between reads."""
        now = time.monotonic()
        for candidate in list(self._waiting):
            if now - candidate.offered > CANDIDATE_TTL_S:  # the node was busy all along
                self._drop(candidate)
        running = self._running
        if running is not None:
            if running.future.done():
                self._finish(running)
            elif now - running.started > PROBE_TIMEOUT_S:
                self._give_up(running)
            return
        self._idle_ticks = self._idle_ticks + 1 if idle else 0
        due = [c for c in self._waiting if self._not_before.get(c.mount, 0.0) <= now]
        if self._idle_ticks < IDLE_TICKS or not due:
            return
        mount = due[0].mount
        files = [c for c in self._waiting if c.mount == mount][:MAX_PER_MOUNT]
        for candidate in files:
            self._waiting.remove(candidate)
        probe = _Probe(files)
        probe.future = self._pool.submit(self._probe, probe, busy)
        self._running = probe

    def _probe(self, probe: _Probe, busy: Callable[[], bool]) -> _Measured:
        """In the probe's thread: find the places (one mincore pass per file and a bounded
        number of SEEK_HOLE calls), then measure, through one fresh descriptor per file.
        Touches nothing of the prober but ``probe.read`` and ``probe.touching``."""

        def touch(index: int) -> None:
            probe.touching = index

        with contextlib.ExitStack() as streams:
            fds = []
            for index, candidate in enumerate(probe.files):
                touch(index)
                try:
                    fds.append(streams.enter_context(candidate.file.stream()))
                except (OSError, FileChangedError) as exc:
                    raise FileFailed(index, 0, exc) from exc
                streams.callback(touch, index)  # closed next, on the way out
            files = list(zip(fds, (c.file.size for c in probe.files), strict=True))
            plan = plan_seek_measurement(files, busy=busy, touch=touch)
            device = probe.files[0].file.identity.device
            before, started = device_read_bytes(device), time.monotonic()

            def forget(index: int, start: int, stop: int) -> None:
                """What the probe read leaves the page cache at once, from the probe's
                thread: dropped at the probe's end, they would take with them pages
                another process has read since (32 MiB in an attack run). Not once a
                request has come: it may be warming, or have found resident, those very
                pages."""
                if busy():
                    return
                with contextlib.suppress(OSError):
                    os.posix_fadvise(fds[index], start, stop - start, os.POSIX_FADV_DONTNEED)

            cost = measure_seek_cost(
                fds,
                plan,
                busy=busy,
                chunk_bytes=self._chunk,
                read=probe.read,
                touch=touch,
                forget=forget,
            )
            after, seconds = device_read_bytes(device), time.monotonic() - started
            own = sum(stop - start for _, start, stop in probe.read)
            foreign = None if before is None or after is None else after - before - own
            return _Measured(cost, seconds, foreign)

    def _give_up(self, running: _Probe) -> None:
        """A probe stuck in the storage: its thread is lost, its mount not probed again
        this run, and the stuck count of the user whose file it is stuck in goes up; a
        new thread takes the next one."""
        touching = running.touching
        stuck = [] if touching is None else [running.files[touching]]
        mount = running.files[0].mount
        logger.warning(
            "seek cost probe of %s has not returned in %.0f s (in %s): %s is not probed again",
            mount,
            PROBE_TIMEOUT_S,
            ", ".join(c.file.path for c in stuck) or "no file yet",
            mount,
        )
        self._running = None
        running.future.add_done_callback(lambda _: self._close_all(running.files))
        for candidate in stuck:
            self._stuck[candidate.uid] += 1
        if mount_name(running.files[0].file.identity.device) == mount:  # not a reused number
            self._done.add(mount)
        for candidate in list(self._waiting):  # the mount's other files; a stuck user's
            if candidate.mount in self._done or self._stuck[candidate.uid] >= MAX_STUCK_PER_UID:
                self._drop(candidate)
        self._lost += 1
        self._pool.grow_to(self._lost + 1)

    def _finish(self, running: _Probe) -> None:
        self._running = None
        self._idle_ticks = 0  # the next probe waits for idle ticks of its own
        files, mount = running.files, running.files[0].mount
        again: list[_Candidate] = []  # back to waiting for the next idle moment
        try:
            measured = running.future.result()
        except MeasureStopped as exc:
            if exc.retry:  # a request came: the mount waits for the next idle moment
                again = files
            else:  # nothing cold enough here (files read whole, say): others may do
                logger.info(
                    "seek cost of %s not probed on %s: %s",
                    mount,
                    ", ".join(c.file.path for c in files),
                    exc,
                )
                for candidate in files:
                    self._try_elsewhere(candidate)
        except FileFailed as exc:  # that file failed or changed: the others may do
            culprit = files[exc.index]
            logger.warning(
                "seek cost probe of %s on %s failed at offset %d: %s",
                mount,
                culprit.file.path,
                exc.offset,
                exc.reason,
            )
            self._try_elsewhere(culprit)
            again = [c for c in files if c is not culprit]
        except Exception as exc:  # nothing to tell which file: none of them again
            logger.warning("seek cost probe of %s failed: %s", mount, exc)
            for candidate in files:
                self._try_elsewhere(candidate)
        else:
            again = self._learn_undisturbed(running, measured)
        for candidate in again:  # offer() counted them while they ran: still in bounds
            candidate.offered = time.monotonic()
        self._waiting.extend(again)
        self._waiting.sort(key=lambda c: -c.file.size)
        self._close_all([c for c in files if not any(c is a for a in again)])

    def _learn_undisturbed(self, running: _Probe, measured: _Measured) -> list[_Candidate]:
        """Keep the probe's figure, unless something else read the storage while it ran:
        then its files wait for the mount's next idle moment (returned), up to
        ``MAX_DISTURBED`` times; the last time, the least disturbed figure of the run is
        kept."""
        mount, result = running.files[0].mount, measured.cost
        age = self._learned.seek_cost_age(mount)
        if age is not None and age > MAX_AGE_S:
            self._probed[mount] = 0  # the weekly probe: its retries count afresh
        self._probed[mount] += 1
        reason = self._disturbance(mount, measured)
        paths = ", ".join(dict.fromkeys(running.files[i].file.path for i, _, _ in running.read))
        this = (running.files[0].file.identity.device, result, paths)
        if reason is None:
            self._least_disturbed.pop(mount, None)
            self._learn(mount, *this)
            return []
        best = self._least_disturbed.get(mount)
        if best is None or result.window_bytes_per_s > best[1].window_bytes_per_s:
            best = self._least_disturbed[mount] = this
        if self._probed[mount] < MAX_DISTURBED:
            wait = DISTURBED_BACKOFF_S * 2 ** (self._probed[mount] - 1)
            self._not_before[mount] = time.monotonic() + wait
            logger.info(
                "seek cost probe of %s disturbed (%s): probed again when the node is idle, "
                "in %.0f s or later",
                mount,
                reason,
                wait,
            )
            return running.files
        logger.warning(
            "seek cost probes of %s disturbed %d times (last: %s): keeping the fastest",
            mount,
            MAX_DISTURBED,
            reason,
        )
        del self._least_disturbed[mount]
        self._learn(mount, *best)
        return []

    def _disturbance(self, mount: str, measured: _Measured) -> str | None:
        """Why the probe cannot be believed, or None."""
        foreign, lone = measured.foreign_bytes, measured.cost.window_bytes_per_s
        if (
            foreign is not None
            and foreign > FOREIGN_SLACK_BYTES
            and foreign > FOREIGN_SHARE * lone * measured.seconds
        ):
            return (
                f"the device read {foreign / 2**20:.1f} MiB besides the probe's in "
                f"{measured.seconds:.2f} s"
            )
        if self._learned.below_own_streams(mount, lone):
            daemon = self._learned.learned_bytes_per_s(mount)
            return (
                f"one lone stream {lone / 2**20:.1f} MiB/s, below one of the daemon's "
                f"{daemon / 2**20:.1f} MiB/s"
            )
        return None

    def _learn(self, mount: str, device: int, result: SeekCost, paths: str) -> None:
        if mount_name(device) != mount:  # its device number reused
            logger.warning("%s is no longer mounted: its seek cost is not kept", mount)
            return
        self._learned.learn_seek_cost(device, result.seek_cost, result.window_bytes_per_s)
        for other in list(self._waiting):  # the mount's other files: not needed now
            if other.mount == mount:
                self._drop(other)
        logger.info(
            "seek cost of %s: %d bytes (probed on %s: %.2f ms per seek over %d seeks, "
            "one stream %.1f MiB/s, %.3f MiB/s over the long window)",
            mount,
            result.seek_cost,
            paths,
            result.seek_s * 1e3,
            result.seeks,
            result.stream_bytes_per_s / 2**20,
            result.window_bytes_per_s / 2**20,
        )

    def _close_all(self, files: list[_Candidate]) -> None:
        for candidate in files:
            self._close(candidate.file.fd, ("dev", candidate.file.identity.device))

    def _drop(self, candidate: _Candidate) -> None:
        self._waiting.remove(candidate)
        self._close(candidate.file.fd, ("dev", candidate.file.identity.device))

    def _try_elsewhere(self, candidate: _Candidate) -> None:
        """Not this file again, whatever its mtime (a user's file that fails, or changes
        under the probe, must not keep its mount from being probed on another one), and
        one more failure against the user whose request named it."""
        if len(self._tried) >= MAX_TRIED:
            self._tried.clear()
        self._tried.add(_key(candidate))
        self._failed[candidate.uid] += 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        running = self._running
        if running is not None:
            running.future.add_done_callback(lambda _: self._close_all(running.files))
        self._running = None
        for candidate in list(self._waiting):
            self._drop(candidate)
