"""The node: every live request, one plan per file, readiness per tensor group, the budget.

(What one request needs, cell by cell, is kept by :mod:`spanwarm.daemon.request`.)

Everything here runs on the event loop thread; only the blocking warm operations run
in worker threads. The unit of work is a *cell*: the bytes ``[i*C, (i+1)*C)`` of a file
(C = the chunk size, the device read-ahead window) intersected with the file's plan.

- **Plan.** Each file's plan is the cost model applied to the union of the spans of
  every live request that names it (every rank, every job): bridged runs, or the whole
  file. It is recomputed when a request arrives or leaves, so warming that nobody needs
  any more drops out of the plan and its queued cells are skipped.
- **Need.** A request needs, in each cell its spans touch, the planned bytes between the
  first and last byte it names there (its *hull*). Its tensor groups each wait for the
  cells their spans touch.
- **Readiness.** A request's cell is satisfied when completed warm operations that
  finished after the request arrived cover its need. A group is ready when all its cells
  are. Bytes warmed for one request serve every other one that arrived before the read
  completed, so each byte is read once per node; a late arrival re-checks residency
  (where mincore can be trusted) instead of reading again.
- **Order.** Requests take turns (round robin); each one's cells go in the order its
  spans came, so every rank's first tensors are warm first. Cells the plan reads that no
  request needs (bridged gaps, whole files) take the last turn.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from spanwarm.costmodel import FilePlan, plan_file
from spanwarm.daemon.admission import FileTable, OpenFile
from spanwarm.daemon.budget import available_memory, parse_budget
from spanwarm.daemon.config import DaemonConfig
from spanwarm.daemon.metrics import Metrics
from spanwarm.daemon.request import FAILED, PENDING, READY, CellKey, Event, Range, Request
from spanwarm.daemon.warm_engine import WarmEngine, WarmMethod, default_method
from spanwarm.errors import FileChangedError
from spanwarm.memory_map import MADV_POPULATE_READ, madvise, map_range, unmap
from spanwarm.residency import PAGE, resident_bytes
from spanwarm.spans import SpanTable

__all__ = ["Node"]

logger = logging.getLogger("spanwarm.daemon")


@dataclass
class Cell:
    warm: list[tuple[int, int, float]] = field(default_factory=list)  # (start, stop, completed)
    in_flight: bool = False
    waiters: set[Request] = field(default_factory=set)


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
    madvise(addr, length, MADV_POPULATE_READ)
    return addr, length


def _overlap(xs: list[Range], ys: list[Range]) -> int:
    """Bytes in both of two sorted, disjoint range lists (one linear pass)."""
    total = i = j = 0
    while i < len(xs) and j < len(ys):
        lo, hi = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        total += max(0, hi - lo)
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def _requeue(request: Request, key: CellKey) -> None:
    """Put ``key`` back at the front of the request's queue, but behind the cells of the
    first tensor not ready yet: while the rank starts (first tensors first) or is over the
    budget, ``Node._next`` dispatches only those and stops at the first other cell, so
    one in front would hold the rank's next tensor back."""
    queue = request.queue
    pending = np.flatnonzero(request.state == PENDING)
    at = 0
    if pending.size and not request.serves_group(key, int(pending[0])):
        first = int(pending[0])
        while at < len(queue) and request.serves_group(queue[at], first):
            at += 1
    queue.insert(at, key)


class Node:
    """Owns the live requests, the plans and the warm workers of one daemon."""

    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.chunk = config.chunk_bytes
        self.method = WarmMethod(config.method) if config.method else default_method()
        self.engine = WarmEngine(
            self.method, chunk_bytes=self.chunk, throttle_bytes_per_s=config.throttle_bytes_per_s
        )
        self.files = FileTable(config.allow)
        self.started = time.monotonic()
        self._requests: list[Request] = []
        self._plans: dict[OpenFile, FilePlan] = {}
        self._users: dict[OpenFile, set[Request]] = {}
        self._cells: dict[CellKey, Cell] = {}
        self._background: dict[OpenFile, collections.deque[CellKey]] = {}
        self._turn = 0
        self._in_flight = 0
        self._pool = ThreadPoolExecutor(config.workers, thread_name_prefix="spanwarm-warm")
        self._wake = asyncio.Event()
        self._dispatcher: asyncio.Task[None] | None = None
        self._refresher: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._recent: collections.deque[tuple[float, int]] = collections.deque()
        self.bytes_read_total = 0
        self.bytes_verified_total = 0
        self.metrics = Metrics()
        available = available_memory(cgroup_root=Path(config.cgroup_root))
        self.budget = parse_budget(config.memory_budget, available)
        self._held: dict[CellKey, int] = {}  # warmed bytes per cell, not yet released
        self._held_total = 0
        self._holders: dict[CellKey, dict[Request, float]] = {}  # ready for it, not read yet
        self._in_flight_bytes = 0
        self._budget_blocked = False
        self._mappings: dict[CellKey, list[tuple[int, int]]] = {}  # --hold: (address, length)

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._dispatcher = loop.create_task(self._dispatch(), name="dispatch")
        self._refresher = loop.create_task(self._refresh_metrics(), name="metrics")

    async def _refresh_metrics(self) -> None:
        while True:
            self._expire_holds()
            self.metrics.refresh(self.status())
            await asyncio.sleep(1.0)

    # -- the memory budget -----------------------------------------------------------------

    def consumed(self, request_id: int, groups: Iterable[int]) -> bool:
        """A rank read these groups: cells nobody else holds stop counting against the budget."""
        request = next((r for r in self._requests if r.id == request_id), None)
        if request is None:
            return False
        for key in request.consume(groups):
            self._unhold(key, request)
            self._release_if_free(key)
        return True

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
        for task in (self._dispatcher, self._refresher):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self._pool.shutdown(wait=True)
        for request in list(self._requests):
            self.release(request)
        for mappings in self._mappings.values():
            for addr, length in mappings:
                unmap(addr, length)
        self._mappings.clear()
        self.files.close_all()

    # -- requests ----------------------------------------------------------------------

    def register(self, request: Request) -> None:
        """Add an admitted request (built off the loop with ``Request(admitted, node.chunk)``)."""
        self._requests.append(request)
        for file in request.files:
            self._users.setdefault(file, set()).add(request)
        for key in request.cells:
            self._cells.setdefault(key, Cell()).waiters.add(request)
        needed_before = sum(self._plans[f].needed_bytes for f in request.files if f in self._plans)
        self._replan(request.files)
        needed_after = sum(self._plans[f].needed_bytes for f in request.files if f in self._plans)
        self.metrics.requested.inc(request.nbytes)
        self.metrics.deduped.inc(max(0, request.nbytes - (needed_after - needed_before)))
        empty = np.flatnonzero(request.remaining == 0)
        request.state[empty] = READY
        if empty.size:
            request.events.put_nowait(Event("ready", tuple(empty.tolist())))
        self._finish_if_resolved(request)
        self._wake.set()

    def release(self, request: Request) -> None:
        """The request's stream ended: drop its interest and everything only it needed."""
        if request not in self._requests:
            return
        self._requests.remove(request)
        for key in request.cells:
            cell = self._cells.get(key)
            if cell is not None:
                cell.waiters.discard(request)
            self._unhold(key, request)
        for file in request.files:
            self._users[file].discard(request)
        self._replan(request.files)
        for file in request.files:
            if not self._users[file]:
                del self._users[file]
                self._plans.pop(file, None)
                for key in [
                    k for k in self._cells if k[0] is file and not self._cells[k].in_flight
                ]:
                    del self._cells[key]
        for file in request.acquired:
            self.files.release(file)
        for key in request.cells:
            self._release_if_free(key)

    def plan_of(self, request: Request) -> list[FilePlan]:
        return [self._plans[f] for f in request.files if f in self._plans]

    def _replan(self, files: Iterable[OpenFile]) -> None:
        for file in files:
            users = self._users.get(file)
            if not users:
                self._background.pop(file, None)
                continue
            table = SpanTable.concat(r.files[file] for r in users)
            plan = plan_file(file.path, file.size, table, self.config.seek_cost)
            self._plans[file] = plan
            self._background[file] = collections.deque(self._unneeded_cells(file, plan))

    def _unneeded_cells(self, file: OpenFile, plan: FilePlan) -> list[CellKey]:
        """Cells the plan reads that no request needs: bridged gaps and whole files."""
        first, last = plan.runs.starts // self.chunk, (plan.runs.stops - 1) // self.chunk
        counts = last - first + 1
        offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        cells = np.unique(np.repeat(first, counts) + offsets)
        out: list[CellKey] = []
        for cell in cells.tolist():
            state = self._cells.get((file, cell))
            if state is None or not state.waiters:
                out.append((file, cell))
        return out

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
        lo, hi = request.hull(key)
        valid = _union((a, b) for a, b, t in self._cells[key].warm if t >= request.arrival)
        return not _subtract(self._planned(key, lo, hi), valid)

    def _to_read(self, key: CellKey) -> list[Range]:
        cell = self._cells.setdefault(key, Cell())
        waiters = [r for r in cell.waiters if key in r.pending]
        if not waiters:  # background: whatever of the plan was never warmed
            return _subtract(self._planned(key, 0, 2**62), _union((a, b) for a, b, _ in cell.warm))
        hulls = [r.hull(key) for r in waiters]
        lo = min(h[0] for h in hulls)
        hi = max(h[1] for h in hulls)
        since = max(r.arrival for r in waiters)
        return _subtract(
            self._planned(key, lo, hi), _union((a, b) for a, b, t in cell.warm if t >= since)
        )

    def _next(self, over_budget: bool = False) -> tuple[CellKey, list[Range]] | None:
        """The next cell to warm: requests take turns, background cells go last.

        Until every request's first tensor is ready, only cells of first tensors go: each
        rank is blocked on its first tensor, and sharing the storage with reads for later
        tensors would only delay it. Over the budget, only a cell that
        ``Request.may_exceed_budget`` allows still goes.
        """
        starting = {r for r in self._requests if r.groups and r.state[0] == PENDING}
        participants: list[Request | None] = [*self._requests, None]
        for step in range(len(participants)):
            who = participants[(self._turn + step) % len(participants)]
            if who is None and (over_budget or starting):
                continue
            if starting and who not in starting:
                continue
            queue = self._background_queue() if who is None else who.queue
            while queue:
                key = queue.popleft()
                cell = self._cells.get(key)
                if who is not None and key not in who.pending:
                    continue
                if (cell is not None and cell.in_flight) or key[0] not in self._plans:
                    continue  # in flight: its waiters are re-checked when it completes
                held_back = who is not None and (
                    (over_budget and not who.may_exceed_budget(key))
                    or (who in starting and not who.serves_group(key, 0))
                )
                if held_back:
                    queue.appendleft(key)
                    break
                ranges = self._to_read(key)
                if not ranges:
                    if who is not None:
                        self._settle(key)
                    continue
                self._turn = (self._turn + step + 1) % len(participants)
                return key, ranges
        return None

    def _background_queue(self) -> collections.deque[CellKey]:
        """The first file's queue of cells only the plan needs (empty when there are none,
        or when the plan exceeds the budget: then only what ranks need is warmed)."""
        if sum(p.warm_bytes for p in self._plans.values()) > self.budget:
            return collections.deque()
        for file, queue in list(self._background.items()):
            if queue:
                return queue
            del self._background[file]
        return collections.deque()

    # -- warming ---------------------------------------------------------------------------

    async def _dispatch(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._in_flight < self.config.workers:
                self._budget_blocked = self._over_budget()
                item = self._next(over_budget=self._budget_blocked)
                if item is None:
                    break
                key, ranges = item
                self._cells[key].in_flight = True
                self._in_flight += 1
                self._in_flight_bytes += sum(b - a for a, b in ranges)
                task = asyncio.get_running_loop().create_task(self._warm(key, ranges))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _warm(self, key: CellKey, ranges: list[Range]) -> None:
        file = key[0]
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        try:
            read, verified, kept = await loop.run_in_executor(
                self._pool, self._warm_blocking, file, ranges
            )
        except FileChangedError as exc:
            self._fail_file(file, exc.grpc_code, str(exc))
        except OSError as exc:
            where = f"{file.path}: {exc.strerror or exc} (at offset {ranges[0][0]})"
            self._fail_cell(key, "UNAVAILABLE", where)
        else:
            done = time.monotonic()
            self._cells[key].warm.extend((a, b, done) for a, b in ranges)
            warmed = sum(b - a for a, b in ranges)
            self._mappings.setdefault(key, []).extend(kept)
            self._held[key] = self._held.get(key, 0) + warmed
            self._held_total += warmed
            self.bytes_read_total += read
            self.bytes_verified_total += verified
            self.metrics.warmed.labels(str(self.method)).inc(read)
            self.metrics.resident.inc(verified)
            self.metrics.latency.observe(done - started)
            self._recent.append((done, read + verified))
            self._settle(key)
        finally:
            self._in_flight -= 1
            self._in_flight_bytes -= sum(b - a for a, b in ranges)
            cell = self._cells.get(key)
            if cell is not None:
                cell.in_flight = False
                if not cell.waiters and file not in self._users:
                    del self._cells[key]
            self._release_if_free(key)
            self._wake.set()

    def _warm_blocking(
        self, file: OpenFile, ranges: list[Range]
    ) -> tuple[int, int, list[tuple[int, int]]]:
        """Runs in a worker: warm what is not already resident; (bytes read, bytes found,
        mappings kept under --hold)."""
        read = verified = 0
        kept: list[tuple[int, int]] = []
        with file.stream() as fd:
            for start, stop in ranges:
                resident = resident_bytes(fd, start, stop - start) if file.trusted else 0
                if resident == stop - start:
                    verified += resident
                    continue
                self.engine.warm(fd, [(start, stop)])
                read += stop - start - resident
                verified += resident
            if self.config.hold:
                kept = [_pin(fd, start, stop) for start, stop in ranges]
        return read, verified, kept

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
                _requeue(request, key)  # the read did not cover it: go again, first
                continue
            request.pending.discard(key)
            cell.waiters.discard(request)
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

    def _fail_cell(self, key: CellKey, code: str, reason: str) -> None:
        cell = self._cells.get(key)
        if cell is None:
            return
        for request in list(cell.waiters):
            self._fail(request, key, code, reason)
        cell.waiters.clear()

    def _fail_file(self, file: OpenFile, code: str, reason: str) -> None:
        logger.warning("%s", reason)
        for request in list(self._users.get(file, ())):
            for key in [k for k in request.pending if k[0] is file]:
                self._fail(request, key, code, reason)
                self._cells[key].waiters.discard(request)
        self._plans.pop(file, None)

    def _fail(self, request: Request, key: CellKey, code: str, reason: str) -> None:
        request.pending.discard(key)
        groups = request.cell_groups(key)
        groups = groups[request.state[groups] == PENDING]
        if groups.size:
            request.state[groups] = FAILED
            request.events.put_nowait(Event("failed", tuple(groups.tolist()), code, reason))
            self.metrics.errors.labels(code).inc()
        self._finish_if_resolved(request)

    def _finish_if_resolved(self, request: Request) -> None:
        if request.resolved and not request.finished:
            request.finished = True
            request.events.put_nowait(Event("done"))

    # -- status ------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        while self._recent and self._recent[0][0] < now - 5.0:
            self._recent.popleft()
        window = min(5.0, max(now - self.started, 1e-3))
        throughput = sum(b for _, b in self._recent) / window
        planned = warm = 0
        files = []
        warm_by_file: dict[OpenFile, list[Range]] = {}
        for (file, _), cell in self._cells.items():
            warm_by_file.setdefault(file, []).extend((a, b) for a, b, _ in cell.warm)
        for file, plan in self._plans.items():
            file_warm = _overlap(_union(warm_by_file.get(file, ())), plan.runs.pairs())
            planned += plan.warm_bytes
            warm += file_warm
            files.append({**plan.to_json(), "warm_now_bytes": file_warm})
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
            for r in self._requests
        ]
        left = planned - warm
        return {
            "uptime_s": now - self.started,
            "method": str(self.method),
            "workers": self.config.workers,
            "seek_cost_bytes": self.config.seek_cost,
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
