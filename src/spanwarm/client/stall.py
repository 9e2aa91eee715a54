"""A daemon that is there but stuck must not stall the job: the watchdog's measure.

The channel's keepalive pings catch a frozen or unreachable daemon (the stream ends with
UNAVAILABLE within 15 s), but not one that answers pings and does nothing for this
request: a scheduler stuck behind a hung mount, a plan that never comes. So progress is
clocked: any event for the request's tensors, or a heartbeat whose node-wide byte count
moved since the last one. :func:`watch` releases the ticket once ``stall_timeout``
passes without either while tensors are pending.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["StallClock", "watch"]


class StallClock:
    """When the daemon last showed progress for a request (monotonic seconds, passed in).
    Not locked: the ticket's lock guards it."""

    def __init__(self, now: float) -> None:
        self._at = now
        self._bytes_done = -1  # the node's counter in the last heartbeat

    def progressed(self, now: float) -> None:
        """An event for the request: progress."""
        self._at = now

    def heartbeat(self, bytes_done: int, now: float) -> None:
        """A heartbeat is progress when the node got somewhere since the last one."""
        if bytes_done != self._bytes_done:
            self._bytes_done = bytes_done
            self._at = now

    def stalled_for(self, now: float) -> float:
        """Seconds since the last progress."""
        return now - self._at


def watch(
    finished: threading.Event,
    stalled_for: Callable[[], float],
    release: Callable[[], int],
    stall_timeout: float,
) -> tuple[float, int] | None:
    """Block until ``finished`` is set (None) or ``stalled_for()`` reaches
    ``stall_timeout``: then ``release()`` and return the seconds stalled and what it
    released. Looks several times per ``stall_timeout``, at least every half second."""
    while not finished.wait(min(0.5, stall_timeout / 8)):
        stalled = stalled_for()
        if stalled >= stall_timeout:
            return stalled, release()
    return None
