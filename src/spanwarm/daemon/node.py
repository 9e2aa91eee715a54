"""The node: every live request of one daemon, wired to the parts that serve them.

Everything here runs on the event loop thread; only the blocking warm operations run in
worker threads (and large admissions in helper processes). The unit of work is a *cell*:
the bytes ``[i*C, (i+1)*C)`` of a file (C = the chunk size, the device read-ahead window)
intersected with the file's plan. The parts, one idea each:

- :mod:`~spanwarm.daemon.node_plans`: each file's plan over every live request naming it,
  recomputed in batches; a request becomes *active* (its cells waited on) only once a
  plan including its spans is in place.
- :mod:`~spanwarm.daemon.request`: what one request needs, cell by cell, and its groups.
- :mod:`~spanwarm.daemon.cells`: per cell, what was warmed and when, what failed, who waits.
- :mod:`~spanwarm.daemon.scheduler` and :mod:`~spanwarm.daemon.fair_share`: which cell
  goes next, fair across users, then across a user's ranks, first tensors first.
- :mod:`~spanwarm.daemon.warming` over :mod:`~spanwarm.daemon.page_cache`: the warm
  operation, piece by piece, bad pages narrowed down.
- :mod:`~spanwarm.daemon.readiness`: when a cell is warm for a request, which groups
  are ready or failed.
- :mod:`~spanwarm.daemon.holds`: the memory budget in use (warmed, not yet read).

The node registers and releases requests, takes rank's reports of tensors read
(``--evict-after-read`` drops what nobody needs any more), dispatches operations to the
workers, records their outcomes, and answers ``Status``. Warm, planning and admission
threads are daemon threads: a read hung in the storage is abandoned, never joined.
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

from spanwarm.checkpoint.spans import SpanTable
from spanwarm.daemon.budget import available_memory, follows_memory, parse_budget
from spanwarm.daemon.cells import Cell, CellTable
from spanwarm.daemon.closer import Closer
from spanwarm.daemon.config import DaemonConfig
from spanwarm.daemon.fair_share import FairShare
from spanwarm.daemon.files import FileTable, OpenFile
from spanwarm.daemon.helpers import HelperPool
from spanwarm.daemon.holds import Holds
from spanwarm.daemon.metrics import Metrics
from spanwarm.daemon.node_plans import NodePlans
from spanwarm.daemon.page_cache import KernelPageCache, PageCache
from spanwarm.daemon.ranges import Range, total, union
from spanwarm.daemon.readiness import (
    fail_bad_pages,
    fail_cell_groups,
    finish_if_resolved,
    mark_ready,
    satisfied,
)
from spanwarm.daemon.refusals import Refusals
from spanwarm.daemon.request import FAILED, READY, CellKey, Event, EventKind, Request
from spanwarm.daemon.scheduler import Scheduler
from spanwarm.daemon.seek_probe import SeekProber
from spanwarm.daemon.threads import DaemonThreadPool
from spanwarm.daemon.throughput import StreamThroughput
from spanwarm.daemon.warming import Warmer, WarmOutcome
from spanwarm.errors import FileChangedError
from spanwarm.pagecache.warm_engine import BadRange, WarmEngine, WarmMethod, default_method
from spanwarm.planning.costmodel import DEFAULT_SEEK_COST, FilePlan

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
        # only wait for them): under the daemon's GIL, that work holds up Status for seconds.
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
        self.holds: Holds[CellKey, Request] = Holds(
            self._derived_budget(),
            self.chunk,
            unmap=self.page_cache.unpin,
        )
        self._budget_blocked = False
        self.scheduler = Scheduler(
            self.cells, self.plans, self.share, settle=self._settle, budget=lambda: self.budget
        )
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
                if follows_memory(self.config.memory_budget):
                    self.holds.budget = self._derived_budget()
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

    def _derived_budget(self) -> int:
        """--memory-budget applied to what the node, or the daemon's cgroup, can give now."""
        available = available_memory(cgroup_root=Path(self.config.cgroup_root))
        return parse_budget(self.config.memory_budget, available)

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
            request.events.put_nowait(Event(EventKind.READY, tuple(empty.tolist())))
        finish_if_resolved(request)
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
        warming their cells afterwards would only take the node's CPU and workers from
        the tensors it has not reached. (Other requests waiting on the cell still get it.)
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
            finish_if_resolved(request)

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

    # -- warming -----------------------------------------------------------------------

    async def _dispatch(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self.share.free_worker(time.monotonic()):
                self._budget_blocked = self.holds.over_budget()
                item = self.scheduler.next(self._requests, over_budget=self._budget_blocked)
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
            self.share.preempt = self.scheduler.to_preempt(self._requests)  # read between pieces

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

    # -- readiness ----------------------------------------------------------------------

    def _settle(self, key: CellKey) -> None:
        """Re-check every waiter of a cell after it changed; emit what became ready."""
        cell = self.cells.get(key)
        if cell is None:
            return
        planned = self.plans.planned(key, 0, 2**62)  # once for every waiter
        for request in list(cell.waiters):
            if key not in request.pending:
                continue
            if not satisfied(request, key, cell, planned):
                # The read did not cover it: go again, first. (A rank held to its first
                # tensor finds that tensor's cells wherever they are.)
                request.queue.appendleft(key)
                continue
            cell.unwait(request)
            if not request.consumed[request.cell_groups(key)].all():
                self._hold(key, request)
            mark_ready(request, key)

    def _fail_ranges(self, key: CellKey, bad: list[BadRange]) -> None:
        cell = self.cells.get(key)
        if cell is None:
            return
        for request in list(cell.waiters):
            if key in request.pending:
                failed = fail_bad_pages(request, key[0], bad)
                self.metrics.add(self.metrics.errors, failed, "UNAVAILABLE")
        logger.warning(
            "%s: the storage failed %d bytes (first at offset %d: %s)",
            key[0].path,
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
        if fail_cell_groups(request, key, code, cause):
            self.metrics.add(self.metrics.errors, 1, code)

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
