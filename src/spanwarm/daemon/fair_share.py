"""Whose warm operation goes next: users (uids) share the workers fairly.

The next operation goes to the user the node served least lately (worker time, decaying
by half every ``USAGE_HALF_LIFE`` seconds; running operations count as they run), below
its cap on operations in flight. While such a user has cells waiting and every worker is
busy, heavier users' operations stop at their next piece (:meth:`FairShare.to_preempt`),
so one user's flood of streams cannot starve another user's load. An operation stuck in
a hung read past ``stuck_seconds`` stops counting against the workers (a user's hung
mount holds its threads, not the node's workers). Within a user, its requests take turns.

Pure bookkeeping: callers pass the clock (``now``), so it is tested without threads.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Iterable, Mapping

__all__ = ["OVERTIME_SECONDS", "USAGE_HALF_LIFE", "FairShare"]

USAGE_HALF_LIFE = 10.0  # seconds: how fast a user's past service stops counting against it
OVERTIME_SECONDS = 1.0  # an operation asked to make way that runs on this long frees its worker


class FairShare:
    """Per-uid worker time, operations in flight, and whose turn it is."""

    def __init__(
        self,
        workers: int,
        *,
        stuck_seconds: float,
        user_max_in_flight: int | None,
        trusted_uids: frozenset[int],
    ) -> None:
        self.workers = workers
        self.stuck_seconds = stuck_seconds
        self.user_max_in_flight = user_max_in_flight
        self.trusted_uids = trusted_uids  # no cap on operations in flight
        self.in_flight = 0
        self.user_in_flight: collections.Counter[int] = collections.Counter()
        self.preempt: frozenset[int] = frozenset()  # read by the workers between pieces
        self.unservable: set[int] = set()  # uids the last pick found nothing to warm for
        self._usage: dict[int, tuple[float, float]] = {}  # uid -> (decayed worker s, as of)
        self._started: dict[int, tuple[int, float]] = {}  # operation -> (uid, when)
        self._operations = itertools.count()
        self._turns: dict[int, int] = {}

    # -- operations --------------------------------------------------------------------

    def start(self, uid: int, now: float) -> int:
        """An operation of ``uid`` starts: its id, for :meth:`finish`."""
        operation = next(self._operations)
        self._started[operation] = (uid, now)
        self.in_flight += 1
        self.user_in_flight[uid] += 1
        return operation

    def finish(self, operation: int, now: float, *, served: float | None = None) -> None:
        """The operation ended. ``served``: the worker time to charge its user (none when
        it failed before it read)."""
        uid, _ = self._started.pop(operation)
        self.in_flight -= 1
        self.user_in_flight[uid] -= 1
        if not self.user_in_flight[uid]:
            del self.user_in_flight[uid]
        if served is not None:
            self._charge(uid, served, now)

    @property
    def running(self) -> bool:
        return bool(self._started)

    # -- who goes next -------------------------------------------------------------------

    def order(self, uids: Iterable[int], now: float) -> list[int]:
        """``uids`` least served lately first (then fewest in flight, then uid)."""
        served = self.served(now)
        return sorted(uids, key=lambda u: (served[u], self.user_in_flight[u], u))

    def may_start(self, uid: int, now: float) -> bool:
        """Whether ``uid`` is below its cap on operations in flight (stuck ones aside, up
        to as many stuck as it may have in flight)."""
        stuck = self.stuck(now)[uid]
        cap = self.in_flight_cap(uid)
        return self.user_in_flight[uid] - stuck < cap and stuck < cap

    def free_worker(self, now: float) -> bool:
        """Room for one more operation: fewer than ``workers`` running, not counting those
        stuck in hung storage, nor those asked to make way that have not reached the end
        of their piece within ``OVERTIME_SECONDS`` (slow storage: the lighter user does not
        wait for them)."""
        stuck, overtime = now - self.stuck_seconds, now - OVERTIME_SECONDS
        away = sum(
            1
            for uid, when in self._started.values()
            if when < stuck or (when < overtime and uid in self.preempt)
        )
        return self.in_flight - away < self.workers

    def to_preempt(self, pending: Mapping[int, int], now: float) -> frozenset[int]:
        """Users whose operations should stop at their next piece: every worker is busy,
        and a user served less lately has cells to warm (``pending``: cells waiting per
        uid) that are not in flight. That user gets each freed worker, and what a heavier
        user keeps in flight is what its reads queue behind at the storage."""
        if self.in_flight - sum(self.stuck(now).values()) < self.workers:
            return frozenset()
        if len(pending) < 2:
            return frozenset()
        served = self.served(now)
        starved = [
            served[u]
            for u, cells in pending.items()
            if cells > self.user_in_flight[u] and u not in self.unservable
        ]
        if not starved:
            return frozenset()
        bar = min(starved)
        return frozenset(u for u in self.user_in_flight if served[u] > bar)

    def turn(self, uid: int) -> int:
        """Which of ``uid``'s requests goes first (round robin, modulo their number)."""
        return self._turns.get(uid, 0)

    def took_turn(self, uid: int, next_turn: int) -> None:
        self._turns[uid] = next_turn

    def user_gone(self, uid: int) -> None:
        """``uid`` has no live request: its turn starts over next time."""
        self._turns.pop(uid, None)

    # -- service -------------------------------------------------------------------------

    def stuck(self, now: float) -> collections.Counter[int]:
        """Operations per uid running longer than ``stuck_seconds``: their storage hangs."""
        limit = now - self.stuck_seconds
        return collections.Counter(uid for uid, when in self._started.values() if when < limit)

    def in_flight_cap(self, uid: int) -> int:
        if self.user_max_in_flight is None or uid in self.trusted_uids:
            return self.workers
        return self.user_max_in_flight

    def served(self, now: float) -> collections.defaultdict[int, float]:
        """Worker time per uid lately: finished operations (decayed) and running ones (so
        far), so a user whose reads take long counts as served while they run."""
        served: collections.defaultdict[int, float] = collections.defaultdict(float)
        for uid in self._usage:
            served[uid] = self._usage_of(uid, now)
        for uid, when in self._started.values():
            served[uid] += now - when
        return served

    def forget_idle(self, now: float, keep: int) -> None:
        """Forget users whose service has decayed to nothing, once more than ``keep`` are
        remembered."""
        if len(self._usage) > keep:
            for gone in [u for u in self._usage if self._usage_of(u, now) < 1e-3]:
                del self._usage[gone]

    def _usage_of(self, uid: int, now: float) -> float:
        value, since = self._usage.get(uid, (0.0, now))
        return float(value * 0.5 ** ((now - since) / USAGE_HALF_LIFE))

    def _charge(self, uid: int, seconds: float, now: float) -> None:
        self._usage[uid] = (self._usage_of(uid, now) + seconds, now)
