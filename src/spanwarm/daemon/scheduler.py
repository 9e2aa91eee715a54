"""Which cell is warmed next, and what of it is read.

- **Order.** Users (uids) share the workers fairly (:mod:`~spanwarm.daemon.fair_share`).
  Within a user, its requests take turns (round robin); each one's cells go in the order
  of its tensor groups (the order the rank reads them, across all its files), so every
  rank's first tensors are warm first: until each of a user's ranks has its first tensor,
  only first tensors' cells go. Cells the plan reads that no request needs (bridged gaps,
  whole files) take the last turn, in the turns of the users whose files they are, and
  only while the whole plan fits the budget. Over the budget, only a cell that
  ``Request.may_exceed_budget`` allows goes.
- **What to read.** For the requests waiting on a cell: the planned bytes of their hulls
  not warmed since the latest of them arrived (nor failed since it waited). For a
  background cell: whatever of the plan there was never warmed (or failed).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable

import numpy as np

from spanwarm.daemon.cells import CellTable
from spanwarm.daemon.fair_share import FairShare
from spanwarm.daemon.files import OpenFile
from spanwarm.daemon.node_plans import NodePlans
from spanwarm.daemon.ranges import Range, since, subtract, union
from spanwarm.daemon.request import PENDING, CellKey, CellQueue, Request

__all__ = ["Scheduler"]


class Scheduler:
    """Picks the next cell over the node's cells, plans and fair share.

    ``settle(key)`` re-checks a cell's waiters (a waiter's cell found with nothing left
    to read is settled, not warmed); ``budget()`` is the memory budget.
    """

    def __init__(
        self,
        cells: CellTable[OpenFile, Request],
        plans: NodePlans,
        share: FairShare,
        *,
        settle: Callable[[CellKey], None],
        budget: Callable[[], int],
    ) -> None:
        self._cells = cells
        self._plans = plans
        self._share = share
        self._settle = settle
        self._budget = budget

    def to_read(self, key: CellKey) -> list[Range]:
        cell = self._cells.ensure(key)
        waiters = [r for r in cell.waiters if key in r.pending]
        if not waiters:  # background: whatever of the plan was never warmed (or failed)
            done = union((a, b) for a, b, _ in (*cell.warm, *cell.bad))
            return subtract(self._plans.planned(key, 0, 2**62), done)
        hulls = [r.hull(key) for r in waiters]
        lo = min(h[0] for h in hulls)
        hi = max(h[1] for h in hulls)
        arrived = max(r.arrival for r in waiters)
        failed_since = max(r.activated for r in waiters)
        done = union([*since(cell.warm, arrived), *since(cell.bad, failed_since)])
        return subtract(self._plans.planned(key, lo, hi), done)

    def next(
        self, requests: list[Request], over_budget: bool = False
    ) -> tuple[CellKey, list[Range], int] | None:
        """The next cell to warm among ``requests`` (the live ones), what to read there,
        and the uid whose turn it is: the user served least lately goes first
        (:mod:`~spanwarm.daemon.fair_share`), within its cap on operations in flight."""
        users: dict[int, list[Request]] = {}
        for r in requests:
            if r.active:
                users.setdefault(r.uid, []).append(r)
        now = time.monotonic()
        self._share.unservable.clear()
        for uid in self._share.order(users, now):
            if self._share.may_start(uid, now):
                item = self._next_of(uid, users[uid], over_budget)
                if item is not None:
                    return (*item, uid)
            self._share.unservable.add(uid)  # a worker freed now would not go to it
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
        turn = self._share.turn(uid)
        plans = self._plans.plans
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
                ranges = self.to_read(key)
                if not ranges:
                    if who is not None:
                        self._settle(key)
                    continue
                self._share.took_turn(uid, (turn + step + 1) % len(participants))
                return key, ranges
        return None

    def _first_tensor_cell(self, request: Request, over_budget: bool) -> CellKey | None:
        """A cell of the request's first tensor not ready yet that may be warmed now."""
        pending = np.flatnonzero(request.waiting)
        if not pending.size:
            return None
        for key in request.group_cells(int(pending[0])):
            cell = self._cells.get(key)
            if key not in request.pending or key[0] not in self._plans.plans:
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
        if self._plans.planned_bytes() > self._budget():
            return None
        background = self._plans.background
        for file, queue in list(background.items()):
            if not queue:
                del background[file]
            elif any(file in r.files for r in requests):
                return queue
        return None

    def to_preempt(self, requests: list[Request]) -> frozenset[int]:
        """Users whose operations should stop at their next piece (FairShare.to_preempt)."""
        pending: collections.Counter[int] = collections.Counter()
        for r in requests:
            if r.active:
                pending[r.uid] += len(r.pending)
        return self._share.to_preempt(pending, time.monotonic())
