"""The node: every live request, one plan per file, readiness per tensor group, the budget.

(What one request needs, cell by cell, is kept by :mod:`spanwarm.daemon.request`.)

Everything here runs on the event loop thread; only the blocking warm operations run
in worker threads. The unit of work is a *cell*: the bytes ``[i*C, (i+1)*C)`` of a file
(C = the chunk size, the device read-ahead window) intersected with the file's plan.

- **Plan.** Each file's plan is the cost model applied to the union of the spans of
  every live request that names it (every rank, every job): bridged runs, or the whole
  file. It is recomputed when a request arrives or leaves, so warming that nobody needs
  any more drops out of the plan and its queued cells are skipped. Planning runs in a
  worker thread, in batches (every file that changed since the last batch); a request
  becomes *active* (its cells waited on, its plan event sent) only once a plan that
  includes its spans is in place, so a stale plan can never make it ready early. A plan
  left over from a request that has gone is a superset: harmless.
- **Need.** A request needs, in each cell its spans touch, the planned bytes between the
  first and last byte it names there (its *hull*). Its tensor groups each wait for the
  cells their spans touch.
- **Readiness.** A request's cell is satisfied when pieces of warm operations that
  completed after the request arrived cover its need. A group is ready when all its cells
  are. Bytes warmed for one request serve every other one that arrived before the piece
  completed, so each byte is read once per node; a late arrival re-checks residency
  (where mincore can be trusted) instead of reading again.
- **Order.** Users (uids) share the workers fairly: the next operation goes to the user
  the node served least lately (worker time, decaying by half every
  ``USAGE_HALF_LIFE`` seconds), below its cap on operations in flight; while such
  a user has cells waiting and every worker is busy, heavier users' operations stop at
  their next piece (``_to_preempt``). So one user's flood of streams cannot starve
  another user's load. Within a user, its requests take
  turns (round robin); each one's cells go in the order of its tensor groups (the order
  the rank reads them, across all its files), so every rank's first tensors are warm
  first. Cells the plan reads that no request needs (bridged
  gaps, whole files) take the last turn, in the turns of the users whose files they are.
- **Faults.** A warm operation that fails is narrowed down page by page
  (:func:`~spanwarm.daemon.warm_engine.bad_pages`): the good bytes count as warm, and
  only the groups with a byte on a bad page fail, with the errno and the first bad offset.
- **Shutdown.** Warm, planning and admission threads are daemon threads: a read hung in
  the storage is abandoned, never joined.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import itertools
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from spanwarm.costmodel import DEFAULT_SEEK_COST, FilePlan
from spanwarm.daemon.admission import FileTable, OpenFile
from spanwarm.daemon.budget import available_memory, parse_budget
from spanwarm.daemon.closer import Closer
from spanwarm.daemon.config import DaemonConfig
from spanwarm.daemon.file_plans import FileToPlan, plan_files
from spanwarm.daemon.helpers import HelperPool
from spanwarm.daemon.metrics import Metrics
from spanwarm.daemon.refusals import Refusals
from spanwarm.daemon.request import (
    FAILED,
    PENDING,
    READY,
    CellKey,
    CellQueue,
    Event,
    Range,
    Request,
)
from spanwarm.daemon.seek_probe import SeekProber
from spanwarm.daemon.threads import DaemonThreadPool
from spanwarm.daemon.throughput import StreamThroughput
from spanwarm.daemon.warm_engine import (
    BadRange,
    WarmEngine,
    WarmMethod,
    bad_pages,
    default_method,
)
from spanwarm.errors import FileChangedError
from spanwarm.memory_map import map_range, populate, unmap
from spanwarm.residency import PAGE, resident_bytes
from spanwarm.spans import Intervals, SpanTable

__all__ = ["Node"]

logger = logging.getLogger("spanwarm.daemon")

_PLAN_INLINE = 2_000  # rows a batch may have to be planned on the loop rather than a worker
USAGE_HALF_LIFE = 10.0  # seconds: how fast a user's past service stops counting against it
_PIECES = 8  # a warm operation goes in chunk/8 pieces, and may stop between them (fair share)
_PIECE_SECONDS = 0.25  # a piece slower than this halves the next ones ...
_MIN_PIECE = 128 * 2**10  # ... down to this
_OVERTIME_SECONDS = 1.0  # an operation asked to make way that runs on this long frees its worker
_SAVE_EVERY_TICKS = 30  # learned throughput goes to the state directory every 30 s (if new)


@dataclass(slots=True)
class Cell:
    """One cell's warm history and waiters. A daemon may hold a few hundred thousand: a
    waiter list (rarely more than the node's ranks) and no list until a read fails."""

    warm: list[tuple[int, int, float]] = field(default_factory=list)  # (start, stop, completed)
    in_flight: bool = False
    waiters: list[Request] = field(default_factory=list)
    bad: tuple[tuple[int, int, float], ...] = ()  # failed reads: (start, stop, when)
    read: bool = False  # a rank reported all its bytes here read (--evict-after-read)
    # --evict-after-read: what the daemon itself brought in from storage here (bytes that
    # were resident before it came are someone else's, and stay).
    fetched: tuple[Range, ...] = ()
    # A rank read its bytes here before they were warm, and the cell was dropped from its
    # request: not warmed in the background either (only a request waiting on it does).
    read_first: bool = False

    def wait(self, request: Request) -> None:
        if request not in self.waiters:
            self.waiters.append(request)

    def unwait(self, request: Request) -> None:
        if request in self.waiters:
            self.waiters.remove(request)


@dataclass(slots=True)
class _Outcome:
    """What one warm operation did."""

    read: int = 0  # bytes read from storage
    fetched: list[Range] = field(default_factory=list)  # the pieces those bytes were in
    verified: int = 0  # bytes found resident already
    kept: list[tuple[int, int]] = field(default_factory=list)  # --hold: (address, length)
    bad: list[BadRange] = field(default_factory=list)  # pages the storage failed
    # What it got to (it may stop early), piece by piece, each with when its read
    # completed: a piece warm before a request came is not warm for it (Cell.warm),
    # however long the rest of the operation took. A failed piece's bad pages are in bad.
    pieces: list[tuple[int, int, float]] = field(default_factory=list)
    done: float = 0.0  # when the last read completed (taken in the worker, not on the loop)

    @property
    def covered(self) -> list[Range]:
        return [(a, b) for a, b, _ in self.pieces]


def _since(ranges: Iterable[tuple[int, int, float]], when: float) -> list[Range]:
    """The ranges recorded at or after ``when``, as one sorted, disjoint list."""
    return _union((a, b) for a, b, t in ranges if t >= when)


def _cell_of(file: OpenFile, cell: int) -> CellKey:
    return file, cell


def _to_plan(jobs: list[tuple[OpenFile, list[SpanTable], int]]) -> list[FileToPlan]:
    return [(f.path, f.size, SpanTable.concat(tables), cost) for f, tables, cost in jobs]


def _plan_in_thread(
    jobs: list[tuple[OpenFile, list[SpanTable], int]], chunk: int
) -> list[tuple[FilePlan, npt.NDArray[np.int64]]]:
    return plan_files(_to_plan(jobs), chunk)


def _clip(runs: Iterable[Range], lo: int, hi: int) -> list[Range]:
    return [(max(a, lo), min(b, hi)) for a, b in runs if a < hi and b > lo]


def _subtract(ranges: list[Range], holes: list[Range]) -> list[Range]:
    """``ranges`` minus ``holes`` (both sorted, disjoint)."""
    out: list[Range] = []
    for a, b in ranges:
        for h0, h1 in holes:
            if h1 <= a or h0 >= b:
                continue
            if h0 > a:
                out.append((a, h0))
            a = max(a, h1)
            if a >= b:
                break
        if a < b:
            out.append((a, b))
    return out


def _union(ranges: Iterable[Range]) -> list[Range]:
    out: list[Range] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _pin(fd: int, start: int, stop: int) -> tuple[int, int]:
    """Map a warmed range and fault it in (it is resident: no I/O): mapped pages are not
    reclaimed while the mapping lives, which is what --hold is for."""
    base = start - start % PAGE
    length = stop - base
    addr = map_range(fd, base, length)
    populate(addr, length)
    return addr, length


def _pin_all(fd: int, ranges: list[Range]) -> list[tuple[int, int]]:
    """Pin every range, or none: a mapping that fails (ENOMEM at vm.max_map_count) gives
    back the ones made before it. Pinning is best effort; the bytes are warm either way."""
    kept: list[tuple[int, int]] = []
    try:
        for start, stop in ranges:
            kept.append(_pin(fd, start, stop))
    except OSError as exc:
        logger.warning("--hold: cannot keep a warmed range mapped: %s", exc)
        for addr, length in kept:
            unmap(addr, length)
        return []
    return kept


def _overlap(xs: list[Range], runs: Intervals) -> int:
    """Bytes in both ``xs`` (sorted, disjoint) and ``runs``, vectorised: a plan can have
    millions of runs and Status must stay fast."""
    if not xs or not len(runs):
        return 0
    starts = np.fromiter((a for a, _ in xs), np.int64, len(xs))
    stops = np.fromiter((b for _, b in xs), np.int64, len(xs))
    below = np.concatenate([[0], np.cumsum(stops - starts)])  # bytes of xs before each range

    def covered_below(x: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        i = np.searchsorted(starts, x, side="right") - 1
        inside = np.where(i >= 0, np.minimum(x, stops[i]) - starts[i], 0)
        return np.where(i >= 0, below[np.maximum(i, 0)] + inside, 0)

    return int((covered_below(runs.stops) - covered_below(runs.starts)).sum())


class Node:
    """Owns the live requests, the plans and the warm workers of one daemon."""

    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.chunk = config.chunk_bytes
        self.method = WarmMethod(config.method) if config.method else default_method()
        self.engine = WarmEngine(
            self.method, chunk_bytes=self.chunk, throttle_bytes_per_s=config.throttle_bytes_per_s
        )
        # A close() may wait on a user's FUSE server: never on the loop, and never in a
        # lane another file system's closes wait in (daemon/closer.py).
        self.closer = Closer()
        self._state_pool = DaemonThreadPool(1, "spanwarm-state")
        self.files = FileTable(config.allow, close=self.closer.close)
        self.started = time.monotonic()
        self._requests: list[Request] = []
        self._plans: dict[OpenFile, FilePlan] = {}
        self._users: dict[OpenFile, set[Request]] = {}
        self._cells: dict[CellKey, Cell] = {}
        self._background: dict[OpenFile, CellQueue] = {}
        # Root and the daemon's own user are trusted: no per-user caps.
        self.trusted_uids = frozenset({0, os.geteuid()})
        self._turns: dict[int, int] = {}  # per uid: whose turn among its requests
        self._usage: dict[int, tuple[float, float]] = {}  # uid -> (decayed worker s, as of)
        self._user_in_flight: collections.Counter[int] = collections.Counter()
        self._preempt: frozenset[int] = frozenset()  # uids whose operations should stop
        self._unservable: set[int] = set()  # uids the last dispatch found nothing to warm for
        self._piece = max(PAGE, self.chunk // _PIECES)
        self._in_flight = 0
        # An operation stuck in a hung read longer than stuck_seconds stops counting
        # against --workers (_free_worker); the pool grows so the others still have threads.
        self._pool = DaemonThreadPool(config.workers, "spanwarm-warm")
        self._started: dict[int, tuple[int, float]] = {}  # operation -> (uid, when)
        self._operations = itertools.count()
        # Admission stats and opens files (which may block on a mount) and indexes spans;
        # two at a time bounds the memory a burst of large requests takes at once.
        # Both at a lower CPU priority than the event loop (niceness +10): on a busy node,
        # answering Status and streaming readiness come before admitting more work.
        self.admission_pool = DaemonThreadPool(2, "spanwarm-admit", nice=10)
        self._plan_pool = DaemonThreadPool(1, "spanwarm-plan", nice=10)
        # Large requests are decoded, checked and indexed in these (the admission threads
        # only wait for them): under the GIL, that work held up Status for seconds.
        self.helpers = HelperPool(2)
        self._planner: asyncio.Task[None] | None = None
        self._plan_wake = asyncio.Event()
        self._dirty: set[OpenFile] = set()
        self._plan_waiters: list[asyncio.Future[None]] = []
        self._planned_total: int | None = None  # sum of the plans' warm bytes, when known
        self._wake = asyncio.Event()
        self._dispatcher: asyncio.Task[None] | None = None
        self._refresher: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._recent: collections.deque[tuple[float, int]] = collections.deque()
        self.bytes_read_total = 0
        self.bytes_verified_total = 0
        self.metrics = Metrics()
        self.refusals = Refusals()
        available = available_memory(cgroup_root=Path(config.cgroup_root))
        self.budget = parse_budget(config.memory_budget, available)
        self._held: dict[CellKey, int] = {}  # warmed bytes per cell, not yet released
        self._held_total = 0
        self._holders: dict[CellKey, dict[Request, float]] = {}  # ready for it, not read yet
        self._in_flight_bytes = 0
        self._budget_blocked = False
        self._mappings: dict[CellKey, list[tuple[int, int]]] = {}  # --hold: (address, length)
        self.throughput = StreamThroughput(
            config.state_dir or None, use_lone=config.seek_cost is None
        )
        # Each mount's seek cost, probed once the node is idle, unless --seek-cost sets it.
        self.prober = (
            SeekProber(self.throughput, chunk=self.chunk, close=self.closer.close)
            if config.seek_cost is None
            else None
        )
        self._closing = False

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._dispatcher = loop.create_task(self._dispatch(), name="dispatch")
        self._refresher = loop.create_task(self._refresh_metrics(), name="metrics")
        self._planner = loop.create_task(self._plan_loop(), name="plan")

    async def _refresh_metrics(self) -> None:
        for tick in itertools.count(1):
            try:
                self._expire_holds()
                if self._started:  # an operation may have become stuck: workers to reuse
                    self._wake.set()
                self.metrics.refresh(self.status())
                if self.prober is not None:
                    self.prober.tick(idle=not self._requests, busy=self._probe_must_stop)
                if tick % _SAVE_EVERY_TICKS == 0:  # off the loop: a disk may be slow
                    self._state_pool.submit(self.throughput.save)
            except Exception:  # a metrics refresh must never stop the holds from expiring
                logger.exception("refreshing the metrics failed")
            await asyncio.sleep(1.0)

    def _probe_must_stop(self) -> bool:
        """Asked by the seek-cost probe's thread between its reads."""
        return self._closing or bool(self._requests)

    def seek_cost_of(self, file: OpenFile) -> int:
        """The price of a seek on ``file``'s mount: --seek-cost, else what the probe
        measured there, else the default (the seed's cross-region figure)."""
        if self.config.seek_cost is not None:
            return self.config.seek_cost
        return self.throughput.seek_cost(file.identity.device) or DEFAULT_SEEK_COST

    @property
    def in_flight(self) -> int:
        """Warm operations running now."""
        return self._in_flight

    # -- the memory budget -----------------------------------------------------------------

    def request(self, request_id: int) -> Request | None:
        """The live request with this id (None if it has ended or never was)."""
        return next((r for r in self._requests if r.id == request_id), None)

    def user_bytes(self, uid: int) -> int:
        """Bytes the live requests of ``uid`` name."""
        return sum(r.nbytes for r in self._requests if r.uid == uid)

    def user_rows(self, uid: int) -> int:
        """Rows the strided spans of ``uid``'s live requests have."""
        return sum(r.rows for r in self._requests if r.uid == uid)

    def consumed(self, request: Request, groups: Iterable[int]) -> None:
        """A rank read these groups: cells nobody else holds stop counting against the
        budget, and a cell where the rank has read everything it asked for is no longer
        warmed for it. A rank reads a tensor before it is ready when reading it itself is
        sooner (``Ticket.wait_for_read``): on fast storage, for many of its tensors, and
        warming their cells afterwards only took the node's CPU and workers from the
        tensors it has not reached. (Other requests waiting on the cell still get it.)
        Only for a request in the node plan: one still being admitted has nothing warmed
        or queued yet, and its stream must begin with its plan, not end before it."""
        for key in request.consume(groups):
            if request.active and key in request.pending:  # read before it was warmed
                request.pending.discard(key)
                skipped = self._cells.setdefault(key, Cell())
                skipped.unwait(request)
                skipped.read_first = True
            self._unhold(key, request)
            self._release_if_free(key)
            cell = self._cells.get(key)
            if cell is not None:
                cell.read = True
            self._evict_if_done(key)
            self._wake.set()  # even if another rank still holds the cell: this one may go on
        if request.active and request.read_first:
            self._finish_if_resolved(request)

    def _evict_if_done(self, key: CellKey) -> None:
        """--evict-after-read: drop the bytes the daemon read into a cell once a rank has
        read its part and no live request still needs any of them (nothing unread there, no
        waiter, no read in flight). Bytes it found resident stay: they were in the page
        cache before it came (another job's, or tensors a rank read itself without
        asking). Readiness needs warm operations completed after a request arrived, so a
        later request warms the bytes again: nothing is ever reported ready from a record
        of bytes that were dropped. Checked when a rank reports a read, when a request
        ends, and when an operation on the cell ends."""
        cell = self._cells.get(key)
        if not self.config.evict_after_read or cell is None or not cell.read:
            return
        if cell.in_flight or cell.waiters or self._holders.get(key):
            return
        file = key[0]
        if any(r.unread_in(key) for r in self._users.get(file, ())):
            return
        ranges = _union(cell.fetched)
        cell.read = False
        cell.fetched = ()
        # Forget them too: a request already arriving (still being admitted, not yet among
        # the file's users) must not count these bytes as warmed for it.
        cell.warm.clear()
        # Here, on the loop, not in a thread: no request can arrive and have these bytes
        # warmed (and reported ready) between the check above and the drop. DONTNEED only
        # drops clean pages of one cell: no I/O, microseconds.
        try:
            for start, stop in ranges:
                os.posix_fadvise(file.fd, start, stop - start, os.POSIX_FADV_DONTNEED)
        except OSError as exc:
            logger.debug("evict-after-read: %s", exc)
            return
        self.metrics.add(self.metrics.evicted, sum(b - a for a, b in ranges))

    def _hold(self, key: CellKey, request: Request) -> None:
        self._holders.setdefault(key, {})[request] = time.monotonic()
        request.holding.add(key)
        request.unheld.clear()

    def _unhold(self, key: CellKey, request: Request) -> None:
        self._holders.get(key, {}).pop(request, None)
        request.holding.discard(key)
        if not request.holding:
            request.unheld.set()

    def _expire_holds(self) -> None:
        """Holds older than hold_seconds stop counting: a client that never reports what it
        read must not stall warming forever."""
        deadline = time.monotonic() - self.config.hold_seconds
        for key, holders in list(self._holders.items()):
            for request, since in list(holders.items()):
                if since < deadline:
                    self._unhold(key, request)
            self._release_if_free(key)

    def _release_if_free(self, key: CellKey) -> None:
        cell = self._cells.get(key)
        if self._holders.get(key) or (cell is not None and (cell.waiters or cell.in_flight)):
            return
        self._holders.pop(key, None)
        for addr, length in self._mappings.pop(key, ()):
            unmap(addr, length)
        released = self._held.pop(key, 0)
        if released:
            self._held_total -= released
            self._wake.set()

    def _over_budget(self) -> bool:
        """True when one more chunk would take warmed-but-unread bytes past the budget (one
        chunk always goes, so a budget smaller than a chunk still makes progress)."""
        committed = self._held_total + self._in_flight_bytes
        return committed > 0 and committed + self.chunk > self.budget

    async def close(self) -> None:
        """Stop at once: warm operations still running (a hung read, say) are abandoned,
        not waited for; every file and mapping is given back."""
        self._closing = True
        for task in (self._dispatcher, self._refresher, self._planner, *self._tasks):
            if task is not None:
                task.cancel()
        await asyncio.gather(
            *(t for t in (self._dispatcher, self._refresher, self._planner) if t is not None),
            *self._tasks,
            return_exceptions=True,
        )
        for pool in (self._pool, self.admission_pool, self._plan_pool):
            pool.shutdown(wait=False, cancel_futures=True)
        self.helpers.close()
        for request in list(self._requests):
            self.release(request)
        for mappings in self._mappings.values():
            for addr, length in mappings:
                unmap(addr, length)
        self._mappings.clear()
        self.files.close_all()
        if self.prober is not None:
            self.prober.close()
        self._state_pool.shutdown(wait=False)
        self.throughput.save()  # what this run learned, for the next one

    # -- requests ----------------------------------------------------------------------

    async def register(self, request: Request) -> None:
        """Add an admitted request (built off the loop with ``Request(admitted, node.chunk)``)
        and return once it is active: every file's plan includes its spans.

        The caller releases it in every case (``release`` undoes whatever got done), so a
        failure or a cancellation here leaves the node as it was.
        """
        if request.released:  # its stream ended before this began
            return
        self._requests.append(request)
        for file in request.files:
            self._users.setdefault(file, set()).add(request)
            if self.prober is not None:
                self.prober.offer(file, request.uid)
        needed_before = sum(self._plans[f].needed_bytes for f in request.files if f in self._plans)
        await self._replanned(request.files)
        if request not in self._requests:  # released while planning
            return
        for file in request.files:
            if file.failed:  # it changed before this request got its plan: nothing to warm
                for key in request.pending.in_file(file):
                    self._fail(request, key, "ABORTED", "changed while warming")
        for key in request.pending:  # its cells not settled by a failure above
            cell = self._cells.get(key)
            if cell is None:
                cell = self._cells[key] = Cell()
            cell.wait(request)
        request.active = True
        request.activated = time.monotonic()
        needed_after = sum(self._plans[f].needed_bytes for f in request.files if f in self._plans)
        self.metrics.add(self.metrics.requested, request.nbytes)
        self.metrics.add(
            self.metrics.deduped, max(0, request.nbytes - (needed_after - needed_before))
        )
        empty = np.flatnonzero(request.remaining == 0)
        request.state[empty] = READY
        if empty.size:
            request.events.put_nowait(Event("ready", tuple(empty.tolist())))
        self._finish_if_resolved(request)
        self._unservable.discard(request.uid)  # it has work now: worth preempting for
        self._wake.set()

    def release(self, request: Request) -> None:
        """The request's stream ended: drop its interest and everything only it needed.
        Safe to call more than once, and for a request that never became active or was
        never registered (refused after admission, or its client gone before): its files
        go back all the same."""
        if request.released:
            return
        request.released = True
        if request not in self._requests:
            for file in request.acquired:
                self.files.release(file)
            return
        self._requests.remove(request)
        request.active = False
        if not any(r.uid == request.uid for r in self._requests):
            self._turns.pop(request.uid, None)
        for key in request.cells:
            cell = self._cells.get(key)
            if cell is not None:
                cell.unwait(request)
            self._unhold(key, request)
        gone: set[OpenFile] = set()
        for file in request.files:
            users = self._users.get(file)
            if users is not None:
                users.discard(request)
            if not users:
                self._users.pop(file, None)
                self._plans.pop(file, None)
                self._planned_total = None
                self._background.pop(file, None)
                gone.add(file)
        for key in request.cells:  # read by others while this one still needed them
            self._evict_if_done(key)
        if gone:  # one pass over the cells, whatever the number of files
            for key in [k for k, c in self._cells.items() if k[0] in gone and not c.in_flight]:
                del self._cells[key]
        self._mark_dirty(f for f in request.files if f in self._users)
        for file in request.acquired:
            self.files.release(file)
        for key in request.cells:
            self._release_if_free(key)

    # -- planning (in a worker thread, in batches) ---------------------------------------------

    def _mark_dirty(self, files: Iterable[OpenFile]) -> None:
        self._dirty.update(files)
        if self._dirty:
            self._plan_wake.set()

    async def _replanned(self, files: Iterable[OpenFile]) -> None:
        """Wait until a plan computed after this call is in place for ``files``."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._plan_waiters.append(done)
        self._mark_dirty(files)
        self._plan_wake.set()
        await done

    async def _plan_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._plan_wake.wait()
            self._plan_wake.clear()
            dirty, self._dirty = self._dirty, set()
            waiters, self._plan_waiters = self._plan_waiters, []
            jobs = [
                (f, [r.files[f] for r in self._users[f]], self.seek_cost_of(f))
                for f in dirty
                if self._users.get(f) and not f.failed
            ]
            rows = sum(int(t.count.sum()) for _, tables, _ in jobs for t in tables)
            try:
                if rows <= _PLAN_INLINE:  # well under a millisecond: no thread hand-off
                    plans = plan_files(_to_plan(jobs), self.chunk)
                else:
                    # A thread, not a helper process: a batch carries every user's spans
                    # of its files (20 MB for 64 ranks of 10,000), each pipe buffer of it
                    # a GIL round trip with the loop; planned in a helper, the loop stalled
                    # for 4-10 s while ranks were warmed in 3 of 4 bench/bench_load.py runs.
                    plans = await loop.run_in_executor(
                        self._plan_pool, _plan_in_thread, jobs, self.chunk
                    )
                planned = [
                    (file, plan, CellQueue(cells, functools.partial(_cell_of, file)))
                    for (file, _, _), (plan, cells) in zip(jobs, plans, strict=True)
                ]
            except Exception as exc:  # a bug: refuse the requests that waited, keep serving
                logger.exception("planning failed")
                for waiter in waiters:
                    if not waiter.done():
                        waiter.set_exception(RuntimeError(f"planning failed: {exc!r}"))
                continue
            for file, plan, cells in planned:
                if file in self._users and not file.failed:  # still wanted
                    self._plans[file] = plan
                    self._background[file] = cells
            self._planned_total = None
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)
            self._wake.set()

    def plan_of(self, request: Request) -> list[tuple[FilePlan, float]]:
        """The node plan for the request's files, each named as its caller knows it, with
        the stream throughput learned on its device (0.0 while unknown)."""
        return [
            (
                dataclasses.replace(self._plans[f], path=request.name_of(f)),
                self.throughput.bytes_per_s(f.identity.device),
            )
            for f in request.files
            if f in self._plans
        ]

    def _planned(self, key: CellKey, lo: int, hi: int) -> list[Range]:
        """The plan's runs inside the cell, clipped to ``[lo, hi)``."""
        plan = self._plans.get(key[0])
        if plan is None:
            return []
        c0 = key[1] * self.chunk
        lo, hi = max(lo, c0), min(hi, c0 + self.chunk)
        runs = plan.runs
        first = int(np.searchsorted(runs.stops, lo, side="right"))  # first run ending past lo
        last = int(np.searchsorted(runs.starts, hi, side="left"))  # runs starting before hi
        starts, stops = runs.starts[first:last].tolist(), runs.stops[first:last].tolist()
        return _clip(zip(starts, stops, strict=True), lo, hi)

    def _satisfied(self, request: Request, key: CellKey) -> bool:
        """Whether warm operations completed since the request arrived cover its need in
        the cell. Bytes that failed while it waited on the cell are not needed: its groups
        on them failed then (``_fail_ranges``); a failure from before it waited is not
        excused, the bytes are read again."""
        lo, hi = request.hull(key)
        cell = self._cells[key]
        need = _subtract(self._planned(key, lo, hi), _since(cell.bad, request.activated))
        return not _subtract(need, _since(cell.warm, request.arrival))

    def _to_read(self, key: CellKey) -> list[Range]:
        cell = self._cells.get(key)
        if cell is None:
            cell = self._cells[key] = Cell()
        waiters = [r for r in cell.waiters if key in r.pending]
        if not waiters:  # background: whatever of the plan was never warmed (or failed)
            done = _union((a, b) for a, b, _ in (*cell.warm, *cell.bad))
            return _subtract(self._planned(key, 0, 2**62), done)
        hulls = [r.hull(key) for r in waiters]
        lo = min(h[0] for h in hulls)
        hi = max(h[1] for h in hulls)
        since = max(r.arrival for r in waiters)
        failed_since = max(r.activated for r in waiters)
        done = _union([*_since(cell.warm, since), *_since(cell.bad, failed_since)])
        return _subtract(self._planned(key, lo, hi), done)

    def _next(self, over_budget: bool = False) -> tuple[CellKey, list[Range], int] | None:
        """The next cell to warm, and the uid whose turn it is: the user served least
        lately goes first (see Order, above), within its cap on operations in flight."""
        users: dict[int, list[Request]] = {}
        for r in self._requests:
            if r.active:
                users.setdefault(r.uid, []).append(r)
        now = time.monotonic()
        served = self._served(now)
        order = sorted(users, key=lambda u: (served[u], self._user_in_flight[u], u))
        stuck = self._stuck(now)
        self._unservable.clear()
        for uid in order:
            busy = self._user_in_flight[uid] - stuck[uid]
            if busy < self._in_flight_cap(uid) and stuck[uid] < self._in_flight_cap(uid):
                item = self._next_of(uid, users[uid], over_budget)
                if item is not None:
                    return (*item, uid)
            self._unservable.add(uid)  # a worker freed now would not go to it
        return None

    def _to_preempt(self) -> frozenset[int]:
        """Users whose operations should stop at their next piece: every worker is busy,
        and a user served less lately has cells to warm that are not in flight. That user
        gets each freed worker (``_next``), and what a heavier user keeps in flight is what
        its reads queue behind at the storage; the stopped operations go again later."""
        stuck = sum(self._stuck(time.monotonic()).values())
        if self._in_flight - stuck < self.config.workers:
            return frozenset()
        pending: collections.Counter[int] = collections.Counter()
        for r in self._requests:
            if r.active:
                pending[r.uid] += len(r.pending)
        if len(pending) < 2:
            return frozenset()
        served = self._served(time.monotonic())
        starved = [
            served[u]
            for u, cells in pending.items()
            if cells > self._user_in_flight[u] and u not in self._unservable
        ]
        if not starved:
            return frozenset()
        bar = min(starved)
        return frozenset(u for u in self._user_in_flight if served[u] > bar)

    def _stuck(self, now: float) -> collections.Counter[int]:
        """Operations per uid running longer than stuck_seconds: their storage hangs. They
        stop counting against --workers, so other users go on; their user gets no more
        operations once as many are stuck as it may have in flight."""
        limit = now - self.config.stuck_seconds
        return collections.Counter(uid for uid, when in self._started.values() if when < limit)

    def _in_flight_cap(self, uid: int) -> int:
        cap = self.config.user_max_in_flight
        if cap is None or uid in self.trusted_uids:
            return self.config.workers
        return cap

    def _served(self, now: float) -> collections.defaultdict[int, float]:
        """Worker time per uid lately: finished operations (decayed) and running ones (so
        far), so a user whose reads take long counts as served while they run."""
        served: collections.defaultdict[int, float] = collections.defaultdict(float)
        for uid in self._usage:
            served[uid] = self._usage_of(uid, now)
        for uid, when in self._started.values():
            served[uid] += now - when
        return served

    def _usage_of(self, uid: int, now: float) -> float:
        value, since = self._usage.get(uid, (0.0, now))
        return float(value * 0.5 ** ((now - since) / USAGE_HALF_LIFE))

    def _used(self, uid: int, seconds: float) -> None:
        now = time.monotonic()
        self._usage[uid] = (self._usage_of(uid, now) + seconds, now)
        if len(self._usage) > 4 * len(self._requests) + 64:  # forget users long gone
            for gone in [u for u in self._usage if self._usage_of(u, now) < 1e-3]:
                del self._usage[gone]

    def _next_of(
        self, uid: int, requests: list[Request], over_budget: bool
    ) -> tuple[CellKey, list[Range]] | None:
        """The next cell among one user's requests: they take turns, background cells of
        their files go last.

        Until every one of its requests' first tensor is ready, only cells of first tensors
        go: each rank is blocked on its first tensor, and sharing the storage with reads
        for later tensors would only delay it. Over the budget, only a cell that
        ``Request.may_exceed_budget`` allows still goes.
        """
        # Ranks still waiting for their first tensor, and able to start a read for it: one
        # whose first-tensor reads are all in flight (or hung) holds nobody back.
        starting = {
            r
            for r in requests
            if r.groups
            and r.state[0] == PENDING
            and not r.consumed[0]  # read by the rank itself: not waited for
            and self._first_tensor_cell(r, False) is not None
        }
        participants: list[Request | None] = [*requests, None]
        turn = self._turns.get(uid, 0)
        for step in range(len(participants)):
            who = participants[(turn + step) % len(participants)]
            if who is None and (over_budget or starting):
                continue
            if starting and who not in starting:
                continue
            queue = self._background_queue(requests) if who is None else who.queue
            tried: set[CellKey] = set()
            while queue is not None and queue:
                key = queue.popleft()
                cell = self._cells.get(key)
                if who is not None and key not in who.pending:
                    continue
                if (
                    who is None
                    and cell is not None
                    and (cell.waiters or cell.warm or cell.read_first)
                ):
                    continue  # a request's cell: it goes (or went) in that request's turn
                if (cell is not None and cell.in_flight) or key[0] not in self._plans:
                    continue  # in flight: its waiters are re-checked when it completes
                held_back = who is not None and (
                    (over_budget and not who.may_exceed_budget(key))
                    or (who in starting and not who.serves_group(key, 0))
                )
                if held_back and who is not None:
                    # The head may not go, but the rank's first pending tensor may: its
                    # cells can sit anywhere in the queue (one re-queued in front of
                    # them, another request's read in flight when it joined), and waiting
                    # for them to surface at the head would stall the rank for good.
                    queue.appendleft(key)
                    first = self._first_tensor_cell(who, over_budget)
                    if first is None or first in tried:
                        break
                    tried.add(first)
                    key = first
                ranges = self._to_read(key)
                if not ranges:
                    if who is not None:
                        self._settle(key)
                    continue
                self._turns[uid] = (turn + step + 1) % len(participants)
                return key, ranges
        return None

    def _planned_bytes(self) -> int:
        """What the node plan reads, kept per plan generation (asked on every dispatch)."""
        if self._planned_total is None:
            self._planned_total = sum(p.warm_bytes for p in self._plans.values())
        return self._planned_total

    def _first_tensor_cell(self, request: Request, over_budget: bool) -> CellKey | None:
        """A cell of the request's first tensor not ready yet that may be warmed now."""
        pending = np.flatnonzero(request.waiting)
        if not pending.size:
            return None
        for key in request.group_cells(int(pending[0])):
            cell = self._cells.get(key)
            if key not in request.pending or key[0] not in self._plans:
                continue
            if (cell is not None and cell.in_flight) or (
                over_budget and not request.may_exceed_budget(key)
            ):
                continue
            return key
        return None

    def _background_queue(self, requests: list[Request]) -> CellQueue | None:
        """The first queue of cells only the plan needs, in a file these requests name
        (None when there are none, or when the plan exceeds the budget: then only what
        ranks need is warmed)."""
        if self._planned_bytes() > self.budget:
            return None
        for file, queue in list(self._background.items()):
            if not queue:
                del self._background[file]
            elif any(file in r.files for r in requests):
                return queue
        return None

    # -- warming ---------------------------------------------------------------------------

    async def _dispatch(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._free_worker():
                self._budget_blocked = self._over_budget()
                item = self._next(over_budget=self._budget_blocked)
                if item is None:
                    break
                key, ranges, uid = item
                self._cells[key].in_flight = True
                self._in_flight += 1
                self._user_in_flight[uid] += 1
                self._in_flight_bytes += sum(b - a for a, b in ranges)
                self._pool.grow_to(self._in_flight)  # a thread for each, stuck ones too
                operation = next(self._operations)
                self._started[operation] = (uid, time.monotonic())
                task = asyncio.get_running_loop().create_task(
                    self._warm(key, ranges, uid, operation)
                )
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            self._preempt = self._to_preempt()  # read by the workers between pieces

    def _free_worker(self) -> bool:
        """Room for one more operation: fewer than --workers running, not counting those
        stuck in hung storage, nor those asked to make way (``_to_preempt``) that have not
        reached the end of their piece within ``_OVERTIME_SECONDS`` (slow storage: the
        lighter user does not wait for them)."""
        now = time.monotonic()
        stuck, overtime = now - self.config.stuck_seconds, now - _OVERTIME_SECONDS
        away = sum(
            1
            for uid, when in self._started.values()
            if when < stuck or (when < overtime and uid in self._preempt)
        )
        return self._in_flight - away < self.config.workers

    async def _warm(self, key: CellKey, ranges: list[Range], uid: int, operation: int) -> None:
        file = key[0]
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        try:
            outcome = await loop.run_in_executor(
                self._pool, self._warm_blocking, file, ranges, uid, self._cells[key]
            )
        except FileChangedError as exc:
            self._fail_file(file, exc.grpc_code, exc.cause)
        except OSError as exc:  # the file could not even be opened again
            where = f"{exc.strerror or exc} (at offset {ranges[0][0]})"
            self._fail_cell(key, "UNAVAILABLE", where)
        except Exception as exc:  # a bug: fail the cell's waiters, keep the node consistent
            logger.exception("warming %s failed", file.path)
            self._fail_cell(key, "INTERNAL", f"internal error while warming: {exc!r}")
        else:
            done = outcome.done
            logger.debug(
                "warmed %s cell %d for uid %d: %d of %d bytes in %.3f s",
                file.path,
                key[1],
                uid,
                sum(b - a for a, b in outcome.covered),
                sum(b - a for a, b in ranges),
                done - started,
            )
            bad = [(b.start, b.stop) for b in outcome.bad]
            good = [
                (a, b, when)
                for start, stop, when in outcome.pieces
                for a, b in _subtract([(start, stop)], bad)
            ]
            warmed_cell = self._cells[key]
            warmed_cell.warm.extend(good)
            if self.config.evict_after_read and outcome.fetched:
                warmed_cell.fetched += tuple(outcome.fetched)
            warmed = sum(b - a for a, b, _ in good)
            self._mappings.setdefault(key, []).extend(outcome.kept)
            self._held[key] = self._held.get(key, 0) + warmed
            self._held_total += warmed
            self.bytes_read_total += outcome.read
            self.bytes_verified_total += outcome.verified
            self.metrics.add(self.metrics.warmed, outcome.read, str(self.method))
            self.metrics.add(self.metrics.resident, outcome.verified)
            self.metrics.add(self.metrics.latency, done - started)
            self._recent.append((done, outcome.read + outcome.verified))
            # Service is worker time: a user on slow storage, or of many tiny reads, is not
            # "served little" while it keeps workers busy.
            self._used(uid, done - started)
            if outcome.bad:
                self._fail_ranges(key, outcome.bad)
                warmed_cell.bad += tuple((b.start, b.stop, done) for b in outcome.bad)
            self._settle(key)
        finally:
            self._started.pop(operation, None)
            self._in_flight -= 1
            self._user_in_flight[uid] -= 1
            if not self._user_in_flight[uid]:
                del self._user_in_flight[uid]
            self._in_flight_bytes -= sum(b - a for a, b in ranges)
            cell = self._cells.get(key)
            if cell is not None:
                cell.in_flight = False
            self._release_if_free(key)  # first: --hold's pins go, so their pages can too
            if cell is not None:
                # Ranks may have read their part while it was in flight (a rank reading a
                # tensor itself reports it read): nothing else would look again. Only while
                # the file has users: with none its descriptor is closed, or closing.
                if file in self._users:
                    self._evict_if_done(key)
                elif not cell.waiters:
                    del self._cells[key]
            self._wake.set()

    def _pieces(self, ranges: list[Range]) -> Iterator[Range]:
        """``ranges`` in pieces of chunk/8, halved (down to 128 KiB) each time one takes
        over ``_PIECE_SECONDS``: on slow storage, a user asked to make way does so soon."""
        size = self._piece
        for start, stop in ranges:
            while start < stop:
                end = min(stop, start + size)
                began = time.monotonic()
                yield start, end
                if time.monotonic() - began > _PIECE_SECONDS:
                    size = max(_MIN_PIECE, size // 2)
                start = end

    def _warm_blocking(self, file: OpenFile, ranges: list[Range], uid: int, cell: Cell) -> _Outcome:
        """Runs in a worker: warm what is not already resident, piece by piece, stopping
        between pieces when ``uid`` is asked to make way (``_to_preempt``), nobody needs
        the file any more, or nobody waits for the cell since its ranks read it themselves
        (what was done is in ``pieces``). A range the storage fails is
        narrowed down to its bad pages; the rest of it is warmed."""
        outcome = _Outcome()
        if self._all_resident(file, ranges):
            outcome.verified = sum(b - a for a, b in ranges)
            outcome.done = time.monotonic()
            outcome.pieces = [(a, b, outcome.done) for a, b in ranges]
            return outcome
        with file.stream() as fd, self.engine.operation(fd, ranges) as operation:
            for start, stop in self._pieces(ranges):
                # Stop between pieces when asked to make way, when no live request
                # names the file any more (its requests were cancelled), or when the
                # ranks that waited here have read the cell themselves.
                if outcome.pieces and (
                    uid in self._preempt
                    or file not in self._users
                    or (cell.read_first and not cell.waiters)
                ):
                    break
                resident = (
                    resident_bytes(fd, start, stop - start, counted=True) if file.trusted else 0
                )
                if resident == stop - start:
                    outcome.verified += resident
                    outcome.pieces.append((start, stop, time.monotonic()))
                    continue
                io_before = self.engine.io_seconds()
                try:
                    operation.warm(start, stop)
                except FileChangedError:
                    raise
                except OSError:
                    outcome.bad.extend(bad_pages(fd, start, stop))
                else:
                    if not resident:  # a cold read: what one stream gets here
                        io = self.engine.io_seconds() - io_before
                        self.throughput.record(file.identity.device, stop - start, io)
                # Taken after the read (its good pages, where it failed: _warm takes the
                # bad ones out).
                outcome.pieces.append((start, stop, time.monotonic()))
                outcome.read += stop - start - resident
                outcome.fetched.append((start, stop))
                outcome.verified += resident
            # Replaced, deleted or moved out while these pieces were read: not ready.
            file.check_in_place(fd)
            if self.config.hold:
                bad = [(b.start, b.stop) for b in outcome.bad]
                outcome.kept = _pin_all(fd, _subtract(outcome.covered, bad))
        outcome.done = time.monotonic()
        return outcome

    def _all_resident(self, file: OpenFile, ranges: list[Range]) -> bool:
        """Whether the operation has nothing to read: every page of its ranges is in the
        page cache now (one mincore over their envelope, through the descriptor held, and
        the file unchanged). A load of a resident checkpoint then costs the daemon no
        stream (an open is a round trip on a network mount) and no check per piece.
        Not with ``--hold``, whose pins need the pieces mapped."""
        if not file.trusted or self.config.hold or not ranges:
            return False
        lo, hi = min(a for a, _ in ranges), max(b for _, b in ranges)
        if resident_bytes(file.fd, lo, hi - lo) != hi - lo:
            return False
        file.check_in_place()
        return True

    # -- readiness -----------------------------------------------------------------------

    def _settle(self, key: CellKey) -> None:
        """Re-check every waiter of a cell after it changed; emit what became ready."""
        cell = self._cells.get(key)
        if cell is None:
            return
        for request in list(cell.waiters):
            if key not in request.pending:
                continue
            if not self._satisfied(request, key):
                # The read did not cover it: go again, first. (A rank held to its first
                # tensor finds that tensor's cells wherever they are: _first_tensor_cell.)
                request.queue.appendleft(key)
                continue
            request.pending.discard(key)
            cell.unwait(request)
            if not request.consumed[request.cell_groups(key)].all():
                self._hold(key, request)
            groups = request.cell_groups(key)
            groups = groups[request.state[groups] == PENDING]
            request.remaining[groups] -= 1
            now_ready = groups[request.remaining[groups] == 0]
            if now_ready.size:
                request.state[now_ready] = READY
                request.events.put_nowait(Event("ready", tuple(now_ready.tolist())))
            self._finish_if_resolved(request)

    def _fail_ranges(self, key: CellKey, bad: list[BadRange]) -> None:
        """Fail exactly the groups waiting on this cell with a byte on a bad page: one
        failed event per bad range, naming the errno and where the range starts."""
        cell = self._cells.get(key)
        if cell is None:
            return
        file = key[0]
        for request in list(cell.waiters):
            if key not in request.pending:
                continue
            for b in bad:
                groups = request.groups_touching(file, b.start, b.stop)
                groups = groups[request.state[groups] == PENDING]
                if not groups.size:
                    continue
                request.state[groups] = FAILED
                reason = f"{request.name_of(file)}: {b.cause} (at offset {b.start})"
                request.events.put_nowait(
                    Event("failed", tuple(groups.tolist()), "UNAVAILABLE", reason)
                )
                self.metrics.add(self.metrics.errors, 1, "UNAVAILABLE")
            self._finish_if_resolved(request)
        logger.warning(
            "%s: the storage failed %d bytes (first at offset %d: %s)",
            file.path,
            sum(b.stop - b.start for b in bad),
            bad[0].start,
            bad[0].cause,
        )

    def _fail_cell(self, key: CellKey, code: str, cause: str) -> None:
        cell = self._cells.get(key)
        if cell is None:
            return
        for request in list(cell.waiters):
            self._fail(request, key, code, cause)
        cell.waiters.clear()

    def _fail_file(self, file: OpenFile, code: str, cause: str) -> None:
        logger.warning("%s: %s", file.path, cause)
        file.failed = True  # never planned again; a new request opens the file anew
        for request in list(self._users.get(file, ())):
            for key in request.pending.in_file(file):
                self._fail(request, key, code, cause)
                cell = self._cells.get(key)
                if cell is not None:
                    cell.unwait(request)
        self._plans.pop(file, None)
        self._planned_total = None
        self.files.forget(file)  # a later request opens the file afresh

    def _fail(self, request: Request, key: CellKey, code: str, cause: str) -> None:
        """Fail the request's pending groups on this cell; the reason names the file as
        this request's caller knows it."""
        request.pending.discard(key)
        groups = request.cell_groups(key)
        groups = groups[request.state[groups] == PENDING]
        if groups.size:
            request.state[groups] = FAILED
            reason = f"{request.name_of(key[0])}: {cause}"
            request.events.put_nowait(Event("failed", tuple(groups.tolist()), code, reason))
            self.metrics.add(self.metrics.errors, 1, code)
        self._finish_if_resolved(request)

    def _finish_if_resolved(self, request: Request) -> None:
        if not request.finished and request.resolved:  # (resolved looks at every group)
            request.finished = True
            request.events.put_nowait(Event("done"))

    # -- status ------------------------------------------------------------------------------

    def refused(self, exc: BaseException) -> None:
        """Count a refused grant or Warm request by its cause (Status, metrics)."""
        self.metrics.add(self.metrics.refusals, 1, self.refusals.count(exc))

    def status(self, visible: Callable[[Request], bool] | None = None) -> dict[str, Any]:
        """The node's state. With ``visible``, only the ranks it accepts are listed, and
        only the files they name; the totals are the node's."""
        now = time.monotonic()
        while self._recent and self._recent[0][0] < now - 5.0:
            self._recent.popleft()
        window = min(5.0, max(now - self.started, 1e-3))
        throughput = sum(b for _, b in self._recent) / window
        planned = warm = 0
        files = []
        warm_by_file: dict[OpenFile, list[Range]] = {}
        for (file, _), cell in self._cells.items():
            if cell.warm:  # most cells, while ranks are admitted: no generator for them
                warm_by_file.setdefault(file, []).extend([(a, b) for a, b, _ in cell.warm])
        shown = [r for r in self._requests if visible is None or visible(r)]
        named: dict[OpenFile, str] = {}  # what the shown requests' callers call each file
        for r in shown:
            for f in r.files:
                named.setdefault(f, r.name_of(f))
        for file, plan in self._plans.items():
            file_warm = _overlap(_union(warm_by_file.get(file, ())), plan.runs)
            planned += plan.warm_bytes
            warm += file_warm
            if visible is None:
                files.append({**plan.to_json(), "warm_now_bytes": file_warm})
            elif file in named:
                files.append({**plan.to_json(), "path": named[file], "warm_now_bytes": file_warm})
        ranks = [
            {
                "job": r.job,
                "rank": r.rank,
                "groups": len(r.groups),
                "groups_ready": int((r.state == READY).sum()),
                "groups_failed": int((r.state == FAILED).sum()),
                "bytes_requested": r.nbytes,
                "bytes_ready": int(r.group_bytes[r.state == READY].sum()),
                "age_s": now - r.arrival,
            }
            for r in shown
        ]
        left = planned - warm
        return {
            "uptime_s": now - self.started,
            "method": str(self.method),
            "workers": self.config.workers,
            "seek_cost_bytes": self.config.seek_cost
            if self.config.seek_cost is not None
            else DEFAULT_SEEK_COST,
            "ranks": ranks,
            "files": files,
            "bytes_requested": sum(r.nbytes for r in self._requests),
            "bytes_planned": planned,
            "bytes_warm": warm,
            "bytes_read_total": self.bytes_read_total,
            "bytes_verified_total": self.bytes_verified_total,
            "throughput_bytes_per_s": throughput,
            "eta_s": left / throughput if left > 0 and throughput > 0 else 0.0,
            "queue_depth": sum(len(r.pending) for r in self._requests)
            + sum(len(q) for q in self._background.values()),
            "in_flight": self._in_flight,
            "budget_bytes": self.budget,
            "held_bytes": self._held_total,
            "waiting_for_budget": sum(len(r.pending) for r in self._requests)
            if self._budget_blocked
            else 0,
            "waiting_reason": (
                f"{self._held_total} bytes warmed and not yet read, {self._in_flight_bytes} in "
                f"flight, budget {self.budget}: waiting for ranks to report tensors read"
            )
            if self._budget_blocked
            else "",
        }
