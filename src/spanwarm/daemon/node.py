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
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from spanwarm.costmodel import DEFAULT_SEEK_COST, FilePlan
from spanwarm.daemon.admission import FileTable, OpenFile
from spanwarm.daemon.budget import available_memory, parse_budget
from spanwarm.daemon.cells import Cell, CellTable
from spanwarm.daemon.closer import Closer
from spanwarm.daemon.config import DaemonConfig
from spanwarm.daemon.fair_share import FairShare
from spanwarm.daemon.helpers import HelperPool
from spanwarm.daemon.holds import Holds
from spanwarm.daemon.metrics import Metrics
from spanwarm.daemon.node_plans import NodePlans
from spanwarm.daemon.page_cache import KernelPageCache, PageCache
from spanwarm.daemon.ranges import Range, since, subtract, total, union
from spanwarm.daemon.refusals import Refusals
from spanwarm.daemon.request import FAILED, PENDING, READY, CellKey, CellQueue, Event, Request
from spanwarm.daemon.seek_probe import SeekProber
from spanwarm.daemon.threads import DaemonThreadPool
from spanwarm.daemon.throughput import StreamThroughput
from spanwarm.daemon.warm_engine import BadRange, WarmEngine, WarmMethod, default_method
from spanwarm.daemon.warming import Warmer, WarmOutcome
from spanwarm.errors import FileChangedError
from spanwarm.spans import SpanTable

__all__ = ["Node"]

logger = logging.getLogger("spanwarm.daemon")

_SAVE_EVERY_TICKS = 30  # learned throughput goes to the state directory every 30 s (if new)


class Node:
    """Owns the live requests, the plans and the warm workers of one daemon, and answers
    the service: its parts are the plans (:class:`NodePlans`), the cells
    (:class:`CellTable`), fair share (:class:`FairShare`), the budget in use
    (:class:`Holds`) and warming (:class:`Warmer` over a :class:`PageCache`)."""

    def __init__(self, config: DaemonConfig, page_cache: PageCache | None = None) -> None:
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
        self._by_id: dict[int, Request] = {}
        self._users: dict[OpenFile, set[Request]] = {}
        self.cells: CellTable[OpenFile, Request] = CellTable()
        # Root and the daemon's own user are trusted: no per-user caps.
        self.trusted_uids = frozenset({0, os.geteuid()})
        self.share = FairShare(
            config.workers,
            stuck_seconds=config.stuck_seconds,
            user_max_in_flight=config.user_max_in_flight,
            trusted_uids=self.trusted_uids,
        )
        self.page_cache: PageCache = page_cache or KernelPageCache(self.engine)
        self.warmer = Warmer(
            self.page_cache, self.chunk, hold=config.hold, on_cold_read=self._cold_read
        )
        # An operation stuck in a hung read longer than stuck_seconds stops counting
        # against --workers (FairShare.free_worker); the pool grows so the others still
        # have threads.
        self._pool = DaemonThreadPool(config.workers, "spanwarm-warm")
        # Admission stats and opens files (which may block on a mount) and indexes spans;
        # two at a time bounds the memory a burst of large requests takes at once.
        # Both at a lower CPU priority than the event loop (niceness +10): on a busy node,
        # answering Status and streaming readiness come before admitting more work.
        self.admission_pool = DaemonThreadPool(2, "spanwarm-admit", nice=10)
        # Large requests are decoded, checked and indexed in these (the admission threads
        # only wait for them): under the GIL, that work held up Status for seconds.
        self.helpers = HelperPool(2)
        self.plans = NodePlans(
            self.chunk,
            spans_of=self._spans_of,
            seek_cost_of=self.seek_cost_of,
            on_planned=self._planned_now,
        )
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
        self.holds: Holds[CellKey, Request] = Holds(
            parse_budget(config.memory_budget, available),
            self.chunk,
            unmap=self.page_cache.unpin,
        )
        self._budget_blocked = False
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
        self.plans.start()

    async def _refresh_metrics(self) -> None:
        for tick in itertools.count(1):
            try:
                self._expire_holds()
                if self.share.running:  # an operation may have become stuck: workers to reuse
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
        return self.share.in_flight

    @property
    def budget(self) -> int:
        return self.holds.budget

    async def close(self) -> None:
        """Stop at once: warm operations still running (a hung read, say) are abandoned,
        not waited for; every file and mapping is given back."""
        self._closing = True
        for task in (self._dispatcher, self._refresher, *self._tasks):
            if task is not None:
                task.cancel()
        await asyncio.gather(
            *(t for t in (self._dispatcher, self._refresher) if t is not None),
            *self._tasks,
            return_exceptions=True,
        )
        await self.plans.close()
        for pool in (self._pool, self.admission_pool):
            pool.shutdown(wait=False, cancel_futures=True)
        self.helpers.close()
        for request in list(self._requests):
            self.release(request)
        self.holds.close()
        self.files.close_all()
        if self.prober is not None:
            self.prober.close()
        self._state_pool.shutdown(wait=False)
        self.throughput.save()  # what this run learned, for the next one

    # -- requests ----------------------------------------------------------------------

    def request(self, request_id: int) -> Request | None:
        """The live request with this id (None if it has ended or never was)."""
        return self._by_id.get(request_id)

    def user_bytes(self, uid: int) -> int:
        """Bytes the live requests of ``uid`` name."""
        return sum(r.nbytes for r in self._requests if r.uid == uid)

    def user_rows(self, uid: int) -> int:
        """Rows the strided spans of ``uid``'s live requests have."""
        return sum(r.rows for r in self._requests if r.uid == uid)

    async def register(self, request: Request) -> None:
        """Add an admitted request (built off the loop with ``Request(admitted, node.chunk)``)
        and return once it is active: every file's plan includes its spans.

        The caller releases it in every case (``release`` undoes whatever got done), so a
        failure or a cancellation here leaves the node as it was.
        """
        if request.released:  # its stream ended before this began
            return
        self._requests.append(request)
        self._by_id[request.id] = request
        for file in request.files:
            self._users.setdefault(file, set()).add(request)
            if self.prober is not None:
                self.prober.offer(file, request.uid)
        plans = self.plans.plans
        needed_before = sum(plans[f].needed_bytes for f in request.files if f in plans)
        await self.plans.replanned(request.files)
        if request.id not in self._by_id:  # released while planning
            return
        for file in request.files:
            if file.failed:  # it changed before this request got its plan: nothing to warm
                for key in request.pending.in_file(file):
                    self._fail(request, key, "ABORTED", "changed while warming")
        for key in request.pending:  # its cells not settled by a failure above
            self.cells.ensure(key).wait(request)
        request.active = True
        request.activated = time.monotonic()
        needed_after = sum(plans[f].needed_bytes for f in request.files if f in plans)
        self.metrics.add(self.metrics.requested, request.nbytes)
        self.metrics.add(
            self.metrics.deduped, max(0, request.nbytes - (needed_after - needed_before))
        )
        empty = np.flatnonzero(request.remaining == 0)
        request.state[empty] = READY
        if empty.size:
            request.events.put_nowait(Event("ready", tuple(empty.tolist())))
        self._finish_if_resolved(request)
        self.share.unservable.discard(request.uid)  # it has work now: worth preempting for
        self._wake.set()

    def release(self, request: Request) -> None:
        """The request's stream ended: drop its interest and everything only it needed.
        Safe to call more than once, and for a request that never became active or was
        never registered (refused after admission, or its client gone before): its files
        go back all the same."""
        if request.released:
            return
        request.released = True
        if self._by_id.pop(request.id, None) is None:
            for file in request.acquired:
                self.files.release(file)
            return
        self._requests.remove(request)
        request.active = False
        if not any(r.uid == request.uid for r in self._requests):
            self.share.user_gone(request.uid)
        for key in request.cells:
            cell = self.cells.get(key)
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
                self.plans.drop(file)
                gone.add(file)
        for key in request.cells:  # read by others while this one still needed them
            self._evict_if_done(key)
        self.cells.drop_idle(gone)
        self.plans.mark_dirty(f for f in request.files if f in self._users)
        for file in request.acquired:
            self.files.release(file)
        for key in request.cells:
            self._release_if_free(key)

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
                skipped = self.cells.ensure(key)
                skipped.unwait(request)
                skipped.read_first = True
            self._unhold(key, request)
            self._release_if_free(key)
            cell = self.cells.get(key)
            if cell is not None:
                cell.read = True
            self._evict_if_done(key)
            self._wake.set()  # even if another rank still holds the cell: this one may go on
        if request.active and request.read_first:
            self._finish_if_resolved(request)

    def plan_of(self, request: Request) -> list[tuple[FilePlan, float]]:
        """The node plan for the request's files, each named as its caller knows it, with
        the stream throughput learned on its device (0.0 while unknown)."""
        plans = self.plans.plans
        return [
            (
                dataclasses.replace(plans[f], path=request.name_of(f)),
                self.throughput.bytes_per_s(f.identity.device),
            )
            for f in request.files
            if f in plans
        ]

    def _spans_of(self, file: OpenFile) -> list[SpanTable]:
        if file.failed:
            return []
        return [r.files[file] for r in self._users.get(file, ())]

    def _planned_now(self, files: list[OpenFile]) -> None:
        for file in files:
            self.cells.plan_changed(file)
        self._wake.set()

    # -- the memory budget -------------------------------------------------------------

    def _hold(self, key: CellKey, request: Request) -> None:
        self.holds.hold(key, request, time.monotonic())
        request.holding.add(key)
        request.unheld.clear()

    def _unhold(self, key: CellKey, request: Request) -> None:
        self.holds.unhold(key, request)
        request.holding.discard(key)
        if not request.holding:
            request.unheld.set()

    def _expire_holds(self) -> None:
        """Holds older than hold_seconds stop counting: a client that never reports what it
        read must not stall warming forever."""
        for key, request in self.holds.expired(time.monotonic() - self.config.hold_seconds):
            self._unhold(key, request)
        for key in self.holds.held_cells():
            self._release_if_free(key)

    def _release_if_free(self, key: CellKey) -> None:
        cell = self.cells.get(key)
        if self.holds.held_by_anyone(key) or (
            cell is not None and (cell.waiters or cell.in_flight)
        ):
            return
        if self.holds.release(key):
            self._wake.set()

    def _evict_if_done(self, key: CellKey) -> None:
        """--evict-after-read: drop the bytes the daemon read into a cell once a rank has
        read its part and no live request still needs any of them (nothing unread there, no
        waiter, no read in flight). Bytes it found resident stay: they were in the page
        cache before it came (another job's, or tensors a rank read itself without
        asking). Readiness needs warm operations completed after a request arrived, so a
        later request warms the bytes again: nothing is ever reported ready from a record
        of bytes that were dropped. Checked when a rank reports a read, when a request
        ends, and when an operation on the cell ends."""
        cell = self.cells.get(key)
        if not self.config.evict_after_read or cell is None or not cell.read:
            return
        if cell.in_flight or cell.waiters or self.holds.held_by_anyone(key):
            return
        file = key[0]
        if any(r.unread_in(key) for r in self._users.get(file, ())):
            return
        ranges = union(cell.fetched)
        cell.read = False
        cell.fetched = ()
        # Forget them too: a request already arriving (still being admitted, not yet among
        # the file's users) must not count these bytes as warmed for it.
        self.cells.clear_warm(key)
        # Here, on the loop, not in a thread: no request can arrive and have these bytes
        # warmed (and reported ready) between the check above and the drop. DONTNEED only
        # drops clean pages of one cell: no I/O, microseconds.
        try:
            for start, stop in ranges:
                os.posix_fadvise(file.fd, start, stop - start, os.POSIX_FADV_DONTNEED)
        except OSError as exc:
            logger.debug("evict-after-read: %s", exc)
            return
        self.metrics.add(self.metrics.evicted, total(ranges))

    # -- what goes next ----------------------------------------------------------------

    def _satisfied(self, request: Request, key: CellKey) -> bool:
        """Whether warm operations completed since the request arrived cover its need in
        the cell. Bytes that failed while it waited on the cell are not needed: its groups
        on them failed then (``_fail_ranges``); a failure from before it waited is not
        excused, the bytes are read again."""
        lo, hi = request.hull(key)
        cell = self.cells[key]
        need = subtract(self.plans.planned(key, lo, hi), since(cell.bad, request.activated))
        return not subtract(need, since(cell.warm, request.arrival))

    def _to_read(self, key: CellKey) -> list[Range]:
        cell = self.cells.ensure(key)
        waiters = [r for r in cell.waiters if key in r.pending]
        if not waiters:  # background: whatever of the plan was never warmed (or failed)
            done = union((a, b) for a, b, _ in (*cell.warm, *cell.bad))
            return subtract(self.plans.planned(key, 0, 2**62), done)
        hulls = [r.hull(key) for r in waiters]
        lo = min(h[0] for h in hulls)
        hi = max(h[1] for h in hulls)
        arrived = max(r.arrival for r in waiters)
        failed_since = max(r.activated for r in waiters)
        done = union([*since(cell.warm, arrived), *since(cell.bad, failed_since)])
        return subtract(self.plans.planned(key, lo, hi), done)

    def _next(self, over_budget: bool = False) -> tuple[CellKey, list[Range], int] | None:
        """The next cell to warm, and the uid whose turn it is: the user served least
        lately goes first (:mod:`~spanwarm.daemon.fair_share`), within its cap on
        operations in flight."""
        users: dict[int, list[Request]] = {}
        for r in self._requests:
            if r.active:
                users.setdefault(r.uid, []).append(r)
        now = time.monotonic()
        self.share.unservable.clear()
        for uid in self.share.order(users, now):
            if self.share.may_start(uid, now):
                item = self._next_of(uid, users[uid], over_budget)
                if item is not None:
                    return (*item, uid)
            self.share.unservable.add(uid)  # a worker freed now would not go to it
        return None

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
        turn = self.share.turn(uid)
        plans = self.plans.plans
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
                cell = self.cells.get(key)
                if who is not None and key not in who.pending:
                    continue
                if (
                    who is None
                    and cell is not None
                    and (cell.waiters or cell.warm or cell.read_first)
                ):
                    continue  # a request's cell: it goes (or went) in that request's turn
                if (cell is not None and cell.in_flight) or key[0] not in plans:
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
                self.share.took_turn(uid, (turn + step + 1) % len(participants))
                return key, ranges
        return None

    def _first_tensor_cell(self, request: Request, over_budget: bool) -> CellKey | None:
        """A cell of the request's first tensor not ready yet that may be warmed now."""
        pending = np.flatnonzero(request.waiting)
        if not pending.size:
            return None
        for key in request.group_cells(int(pending[0])):
            cell = self.cells.get(key)
            if key not in request.pending or key[0] not in self.plans.plans:
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
        if self.plans.planned_bytes() > self.holds.budget:
            return None
        background = self.plans.background
        for file, queue in list(background.items()):
            if not queue:
                del background[file]
            elif any(file in r.files for r in requests):
                return queue
        return None

    def _to_preempt(self) -> frozenset[int]:
        pending: collections.Counter[int] = collections.Counter()
        for r in self._requests:
            if r.active:
                pending[r.uid] += len(r.pending)
        return self.share.to_preempt(pending, time.monotonic())

    # -- warming -----------------------------------------------------------------------

    async def _dispatch(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self.share.free_worker(time.monotonic()):
                self._budget_blocked = self.holds.over_budget()
                item = self._next(over_budget=self._budget_blocked)
                if item is None:
                    break
                key, ranges, uid = item
                self.cells[key].in_flight = True
                self.holds.in_flight_bytes += total(ranges)
                operation = self.share.start(uid, time.monotonic())
                self._pool.grow_to(self.share.in_flight)  # a thread for each, stuck ones too
                task = asyncio.get_running_loop().create_task(
                    self._warm(key, ranges, uid, operation)
                )
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            self.share.preempt = self._to_preempt()  # read by the workers between pieces

    def _cold_read(self, file: OpenFile, nbytes: int, seconds: float) -> None:
        self.throughput.record(file.identity.device, nbytes, seconds)

    def _warm_blocking(
        self, file: OpenFile, ranges: list[Range], uid: int, cell: Cell[Request]
    ) -> WarmOutcome:
        """In a worker: the warm operation, stopping between pieces when ``uid`` is asked
        to make way (``FairShare.to_preempt``), when no live request names the file any
        more (its requests were cancelled), or when the ranks that waited on the cell
        have read it themselves."""

        def should_stop() -> bool:
            return (
                uid in self.share.preempt
                or file not in self._users
                or (cell.read_first and not cell.waiters)
            )

        return self.warmer.warm(file, ranges, should_stop)

    async def _warm(self, key: CellKey, ranges: list[Range], uid: int, operation: int) -> None:
        file = key[0]
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        served: float | None = None
        try:
            outcome = await loop.run_in_executor(
                self._pool, self._warm_blocking, file, ranges, uid, self.cells[key]
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
            # Service is worker time: a user on slow storage, or of many tiny reads, is not
            # "served little" while it keeps workers busy.
            served = outcome.done - started
            self._warmed(key, ranges, uid, outcome, served)
        finally:
            self.share.finish(operation, time.monotonic(), served=served)
            self.share.forget_idle(time.monotonic(), keep=4 * len(self._requests) + 64)
            self.holds.in_flight_bytes -= total(ranges)
            cell = self.cells.get(key)
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
                    self.cells.drop(key)
            self._wake.set()

    def _warmed(
        self, key: CellKey, ranges: list[Range], uid: int, outcome: WarmOutcome, seconds: float
    ) -> None:
        """Record what an operation warmed, and settle the cell's waiters."""
        logger.debug(
            "warmed %s cell %d for uid %d: %d of %d bytes in %.3f s",
            key[0].path,
            key[1],
            uid,
            total(outcome.covered),
            total(ranges),
            seconds,
        )
        good = outcome.good()
        self.cells.add_warm(key, good)
        cell = self.cells[key]
        if self.config.evict_after_read and outcome.fetched:
            cell.fetched += tuple(outcome.fetched)
        self.holds.warmed(key, sum(b - a for a, b, _ in good), outcome.kept)
        self.bytes_read_total += outcome.read
        self.bytes_verified_total += outcome.verified
        self.metrics.add(self.metrics.warmed, outcome.read, str(self.method))
        self.metrics.add(self.metrics.resident, outcome.verified)
        self.metrics.add(self.metrics.latency, seconds)
        self._recent.append((outcome.done, outcome.read + outcome.verified))
        if outcome.bad:
            self._fail_ranges(key, outcome.bad)
            cell.bad += tuple((b.start, b.stop, outcome.done) for b in outcome.bad)
        self._settle(key)

    # -- readiness -----------------------------------------------------------------------

    def _settle(self, key: CellKey) -> None:
        """Re-check every waiter of a cell after it changed; emit what became ready."""
        cell = self.cells.get(key)
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
        cell = self.cells.get(key)
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
        cell = self.cells.get(key)
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
                cell = self.cells.get(key)
                if cell is not None:
                    cell.unwait(request)
        self.plans.drop(file)
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

    def _planned_in(self, file: OpenFile, cell: int) -> list[Range]:
        return self.plans.planned((file, cell), 0, 2**62)

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
        shown = [r for r in self._requests if visible is None or visible(r)]
        named: dict[OpenFile, str] = {}  # what the shown requests' callers call each file
        for r in shown:
            for f in r.files:
                named.setdefault(f, r.name_of(f))
        for file, plan in self.plans.plans.items():
            file_warm = self.cells.warm_in_plan(file, functools.partial(self._planned_in, file))
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
            + sum(len(q) for q in self.plans.background.values()),
            "in_flight": self.share.in_flight,
            "budget_bytes": self.holds.budget,
            "held_bytes": self.holds.held_total,
            "waiting_for_budget": sum(len(r.pending) for r in self._requests)
            if self._budget_blocked
            else 0,
            "waiting_reason": (
                f"{self.holds.held_total} bytes warmed and not yet read, "
                f"{self.holds.in_flight_bytes} in flight, budget {self.holds.budget}: "
                "waiting for ranks to report tensors read"
            )
            if self._budget_blocked
            else "",
        }
