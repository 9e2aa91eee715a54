"""The memory budget in use: bytes warmed ahead of the ranks and not yet read by them.

A cell a request is ready for is *held* by it until its rank reports the bytes read, or
until ``hold_seconds`` pass (a client that never reports must not stall warming for
good). A cell's warmed bytes count against the budget until no request holds it, waits
on it or warms it; with ``--hold`` its warmed ranges stay mapped until then. Warming
stops (but for what ``Request.may_exceed_budget`` allows) while one more chunk would take
the held and in-flight bytes past the budget.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

__all__ = ["Holds"]

K = TypeVar("K", bound=Hashable)  # a cell
H = TypeVar("H", bound=Hashable)  # who holds it (a request)


class Holds(Generic[K, H]):
    def __init__(self, budget: int, chunk: int, *, unmap: Callable[[int, int], None]) -> None:
        self.budget = budget
        self.chunk = chunk
        self._unmap = unmap
        self.held_total = 0  # warmed, not yet released
        self.in_flight_bytes = 0  # being warmed now
        self._held: dict[K, int] = {}
        self._holders: dict[K, dict[H, float]] = {}  # ready for it, not read yet: since when
        self._mappings: dict[K, list[tuple[int, int]]] = {}  # --hold: (address, length)

    def hold(self, key: K, holder: H, now: float) -> None:
        self._holders.setdefault(key, {})[holder] = now

    def unhold(self, key: K, holder: H) -> None:
        holders = self._holders.get(key)
        if holders is not None:
            holders.pop(holder, None)

    def held_by_anyone(self, key: K) -> bool:
        return bool(self._holders.get(key))

    def expired(self, deadline: float) -> list[tuple[K, H]]:
        """The holds taken before ``deadline``."""
        return [
            (key, holder)
            for key, holders in self._holders.items()
            for holder, since in holders.items()
            if since < deadline
        ]

    def held_cells(self) -> list[K]:
        return list(self._holders)

    def warmed(self, key: K, nbytes: int, kept: list[tuple[int, int]]) -> None:
        """An operation warmed ``nbytes`` in the cell (``kept``: --hold's mappings)."""
        if kept:
            self._mappings.setdefault(key, []).extend(kept)
        self._held[key] = self._held.get(key, 0) + nbytes
        self.held_total += nbytes

    def release(self, key: K) -> int:
        """Nobody holds, waits on or warms the cell: its bytes stop counting and its
        mappings go. The bytes released (0 when none were held)."""
        self._holders.pop(key, None)
        for addr, length in self._mappings.pop(key, ()):
            self._unmap(addr, length)
        released = self._held.pop(key, 0)
        self.held_total -= released
        return released

    def over_budget(self) -> bool:
        """True when one more chunk would take warmed-but-unread bytes past the budget (one
        chunk always goes, so a budget smaller than a chunk still makes progress)."""
        committed = self.held_total + self.in_flight_bytes
        return committed > 0 and committed + self.chunk > self.budget

    def close(self) -> None:
        """Give back every mapping."""
        for mappings in self._mappings.values():
            for addr, length in mappings:
                self._unmap(addr, length)
        self._mappings.clear()
