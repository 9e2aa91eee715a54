"""Where each tensor of a request stands for the rank: still to wait for, or why not.

Every tensor begins :attr:`TensorState.PENDING` and moves once, to one of the final
states; nothing moves it again. The daemon's events, the residency check, the rank's own
reads and the release all race to settle the same tensor (a "ready" may arrive after
the watchdog released it, a report of a read after the daemon warmed it), and the first
word must stand: a reader already told "ready" must not see it pending again, and the
counts in :class:`Progress` must add up to the request.

Two final states are tensors never asked for (:attr:`TensorState.RESIDENT`,
:attr:`TensorState.OWN`): nothing about them goes to the daemon, not even a report that
they were read.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["Progress", "TensorState", "TensorStates"]


class TensorState(enum.IntEnum):
    """One tensor's state. Integers: a million of them sit in one list per request."""

    PENDING = 0
    """Asked for and not warm yet: :meth:`Ticket.wait` waits for it."""
    READY = 1
    """The daemon has warmed its bytes: read it now."""
    FAILED = 2
    """The daemon could not warm it, or its file would not open here: read it cold."""
    RELEASED = 3
    """Let go without the daemon (absent, stalled, ended the stream, or the request was
    cancelled or ended): read it cold, as without spanwarm."""
    RESIDENT = 4
    """In the page cache when the request went out: read at once, never asked for."""
    READ_FIRST = 5
    """Read by this rank before it was warm (reading was sooner than waiting) and
    reported read: nobody waits for it any more."""
    OWN = 6
    """Cold, but so little of the request was cold that this rank reads it sooner than
    asking would cost: never asked for."""

    @property
    def asked_for(self) -> bool:
        """Whether the daemon was asked for it (and so may be told it was read)."""
        return self not in (TensorState.RESIDENT, TensorState.OWN)


@dataclass(frozen=True)
class Progress:
    groups: int
    ready: int
    """Tensors whose bytes the daemon has warmed."""
    failed: int
    """Tensors the daemon could not warm, or released without it (daemon absent or gone)."""
    bytes_total: int
    bytes_ready: int
    resident: int = 0
    """Tensors in the page cache when the request went out: read at once, not asked for."""
    read: int = 0
    """Tensors this rank read before they were warm (reading was sooner than waiting) and
    reported read: nothing waits for them, and the daemon stops warming them for this
    request where nothing the rank has not read shares their cells."""
    own: int = 0
    """Tensors not asked for though not resident: the request's cold bytes were so few
    that this rank reads them sooner than asking would cost
    (:data:`spanwarm.client.read_policy.WORTH_ASKING_S`)."""

    @property
    def done(self) -> bool:
        return self.ready + self.failed + self.resident + self.read + self.own == self.groups


class TensorStates:
    """The states of one request's tensors, by their number in the request.

    Not locked: the ticket's lock guards it (a move and the wake-up of its waiters are
    one step there)."""

    def __init__(self, tensors: int) -> None:
        self._states = [TensorState.PENDING] * tensors
        self._pending = tensors

    def __len__(self) -> int:
        return len(self._states)

    def __getitem__(self, tensor: int) -> TensorState:
        return self._states[tensor]

    @property
    def pending(self) -> int:
        """How many tensors are still pending."""
        return self._pending

    def any_pending(self, tensors: Iterable[int] | None = None) -> bool:
        """Whether any of ``tensors`` (None: of the request) is still pending."""
        if tensors is None:
            return self._pending > 0
        states, pending = self._states, TensorState.PENDING
        return any(states[i] is pending for i in tensors)

    def settle(self, tensors: Iterable[int], state: TensorState) -> list[int]:
        """Move those of ``tensors`` that are still pending to ``state``; returns them, in
        the order given. Numbers outside the request are ignored: they come from the
        daemon's events, and a rank does not fail on a bad one."""
        final = TensorState(state)
        if final is TensorState.PENDING:
            raise ValueError("a tensor cannot move back to PENDING")
        states, n = self._states, len(self._states)
        moved: list[int] = []
        for i in tensors:
            if 0 <= i < n and states[i] is TensorState.PENDING:
                states[i] = final
                moved.append(i)
        self._pending -= len(moved)
        return moved

    def release(self) -> int:
        """Every pending tensor becomes :attr:`TensorState.RELEASED`; returns how many."""
        released = self._pending
        if released:
            pending = TensorState.PENDING
            self._states = [TensorState.RELEASED if s is pending else s for s in self._states]
            self._pending = 0
        return released

    def count(self, *states: TensorState) -> int:
        """How many tensors are in any of ``states``."""
        return sum(1 for s in self._states if s in states)

    def progress(self, nbytes: Sequence[int]) -> Progress:
        """The counts by state, and bytes (``nbytes`` per tensor) of those ready."""
        ready = [i for i, s in enumerate(self._states) if s is TensorState.READY]
        return Progress(
            groups=len(self._states),
            ready=len(ready),
            failed=self.count(TensorState.FAILED, TensorState.RELEASED),
            bytes_total=sum(nbytes),
            bytes_ready=sum(nbytes[i] for i in ready),
            resident=self.count(TensorState.RESIDENT),
            read=self.count(TensorState.READ_FIRST),
            own=self.count(TensorState.OWN),
        )
