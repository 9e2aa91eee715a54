"""The node plan: per file, the cost model over the spans of every live request naming it.

A file's plan is recomputed when a request naming it arrives or leaves, so warming that
nobody needs any more drops out and its queued cells are skipped. Planning runs in
batches (every file that changed since the last batch), in a thread for a large batch.
A request waits (:meth:`NodePlans.replanned`) until a plan computed after it arrived is in
place for its files, so a stale plan can never make it ready early; a plan left over from
a request that has gone is a superset: harmless. Each plan comes with its *background
queue*: every cell it reads, in file order, for what no request waits on (bridged gaps,
whole files).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Iterable

import numpy as np
import numpy.typing as npt

from spanwarm.checkpoint.spans import SpanTable, run_offsets
from spanwarm.daemon.files import OpenFile
from spanwarm.daemon.ranges import Range, clip
from spanwarm.daemon.request import CellKey, CellQueue
from spanwarm.daemon.threads import DaemonThreadPool
from spanwarm.planning.costmodel import FilePlan, plan_file

__all__ = ["NodePlans"]

logger = logging.getLogger("spanwarm.daemon")

PLAN_INLINE = 2_000  # rows a batch may have to be planned on the loop rather than a thread


def _cell_of(file: OpenFile, cell: int) -> CellKey:
    return file, cell


_Job = tuple[OpenFile, list[SpanTable], int]  # a file, its users' spans, its seek cost


def _plan(jobs: list[_Job], chunk: int) -> list[tuple[FilePlan, npt.NDArray[np.int64]]]:
    """Each file's plan at its mount's seek cost, and every ``chunk``-byte cell the plan
    reads, in file order (its background queue). Pure work on arrays (the spans are
    joined here too), in the planning thread for a large batch."""
    out = []
    for file, tables, seek_cost in jobs:
        plan = plan_file(file.path, file.size, SpanTable.concat(tables), seek_cost)
        first, last = plan.runs.starts // chunk, (plan.runs.stops - 1) // chunk
        counts = last - first + 1
        out.append((plan, np.unique(np.repeat(first, counts) + run_offsets(counts))))
    return out


class NodePlans:
    """The plans of every file some live request names, kept current in batches.

    ``spans_of(file)``: the span tables of the file's live requests (none when no live
    request names it, or it failed); ``seek_cost_of(file)``: its mount's seek cost;
    ``on_planned(files)``: called on the loop once new plans are in place.
    """

    def __init__(
        self,
        chunk: int,
        *,
        spans_of: Callable[[OpenFile], list[SpanTable]],
        seek_cost_of: Callable[[OpenFile], int],
        on_planned: Callable[[list[OpenFile]], None],
    ) -> None:
        self.chunk = chunk
        self.plans: dict[OpenFile, FilePlan] = {}
        self.background: dict[OpenFile, CellQueue] = {}
        self._spans_of = spans_of
        self._seek_cost_of = seek_cost_of
        self._on_planned = on_planned
        self._pool = DaemonThreadPool(1, "spanwarm-plan", nice=10)
        self._wake = asyncio.Event()
        self._dirty: set[OpenFile] = set()
        self._waiters: list[asyncio.Future[None]] = []
        self._total: int | None = None  # sum of the plans' warm bytes, when known
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="plan")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def mark_dirty(self, files: Iterable[OpenFile]) -> None:
        """Plan these files again in the next batch."""
        self._dirty.update(files)
        if self._dirty:
            self._wake.set()

    async def replanned(self, files: Iterable[OpenFile]) -> None:
        """Return once a plan computed after this call is in place for ``files``."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(done)
        self.mark_dirty(files)
        self._wake.set()
        await done

    def drop(self, file: OpenFile) -> None:
        """Nobody needs the file any more (or it failed): no plan, no background cells."""
        self.plans.pop(file, None)
        self.background.pop(file, None)
        self._total = None

    def planned(self, key: CellKey, lo: int, hi: int) -> list[Range]:
        """The plan's runs inside the cell, clipped to ``[lo, hi)``."""
        plan = self.plans.get(key[0])
        if plan is None:
            return []
        c0 = key[1] * self.chunk
        lo, hi = max(lo, c0), min(hi, c0 + self.chunk)
        runs = plan.runs
        first = int(np.searchsorted(runs.stops, lo, side="right"))  # first run ending past lo
        last = int(np.searchsorted(runs.starts, hi, side="left"))  # runs starting before hi
        starts, stops = runs.starts[first:last].tolist(), runs.stops[first:last].tolist()
        return clip(zip(starts, stops, strict=True), lo, hi)

    def planned_bytes(self) -> int:
        """What the node plan reads, kept per plan generation (asked on every dispatch)."""
        if self._total is None:
            self._total = sum(p.warm_bytes for p in self.plans.values())
        return self._total

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            dirty, self._dirty = self._dirty, set()
            waiters, self._waiters = self._waiters, []
            jobs = [
                (f, tables, self._seek_cost_of(f)) for f in dirty if (tables := self._spans_of(f))
            ]
            rows = sum(int(t.count.sum()) for _, tables, _ in jobs for t in tables)
            try:
                if rows <= PLAN_INLINE:  # well under a millisecond: no thread hand-off
                    plans = _plan(jobs, self.chunk)
                else:
                    # A thread, not a helper process: a batch carries every user's spans
                    # of its files (20 MB for 64 ranks of 10,000), each pipe buffer of it
                    # a GIL round trip with the loop; planned in a helper, the loop stalls
                    # for 4-10 s while ranks are warmed (3 of 4 bench/bench_load.py runs).
                    plans = await loop.run_in_executor(self._pool, _plan, jobs, self.chunk)
            except Exception as exc:  # a bug: refuse the requests that waited, keep serving
                logger.exception("planning failed")
                for waiter in waiters:
                    if not waiter.done():
                        waiter.set_exception(RuntimeError(f"planning failed: {exc!r}"))
                continue
            installed = []
            for (file, _, _), (plan, cells) in zip(jobs, plans, strict=True):
                if self._spans_of(file):  # still wanted
                    self.plans[file] = plan
                    self.background[file] = CellQueue(cells, functools.partial(_cell_of, file))
                    installed.append(file)
            self._total = None
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)
            self._on_planned(installed)
