"""Descriptors closed off the event loop, in lanes that cannot hold each other up.

A ``close()`` on a FUSE mount waits for its server (``FLUSH``, ``RELEASE``), and a user may
run that server and never answer. With one shared pool of two threads, two such closes
stopped every user's closes for good (an attack run: 160 descriptors of another user
leaked over its next 160 requests). Here each lane has a thread of its own, started when
something is queued in the lane and ended when the lane is empty: a file's lane is its
file system (``("dev", st_dev)``), a refused descriptor's the uid that sent it
(``("uid", uid)``), so a hung file system or a hostile sender holds up only its own
closes. Lanes are bounded (``MAX_LANES`` at once): past that, a close waits in the
overflow lane, which the attack above needs 256 hung file systems to fill.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
from collections.abc import Hashable

__all__ = ["MAX_LANES", "Closer"]

MAX_LANES = 256
_OVERFLOW: Hashable = ("overflow",)


class Closer:
    """Closes descriptors in per-lane daemon threads (thread-safe)."""

    def __init__(self, max_lanes: int = MAX_LANES) -> None:
        self._max_lanes = max_lanes
        self._lanes: dict[Hashable, collections.deque[int]] = {}
        self._lock = threading.Lock()

    def close(self, fd: int, lane: Hashable) -> None:
        """Close ``fd`` soon, after the descriptors queued before it in ``lane``."""
        with self._lock:
            if lane not in self._lanes and len(self._lanes) >= self._max_lanes:
                lane = _OVERFLOW
            queued = self._lanes.get(lane)
            if queued is not None:
                queued.append(fd)
                return
            self._lanes[lane] = collections.deque([fd])
        try:
            threading.Thread(
                target=self._drain, args=(lane,), name="spanwarm-close", daemon=True
            ).start()
        except RuntimeError:  # no thread to be had (a thread limit): close it here
            with self._lock:
                queued = self._lanes.pop(lane)
            for left in queued:
                with contextlib.suppress(OSError):
                    os.close(left)

    def _drain(self, lane: Hashable) -> None:
        while True:
            with self._lock:
                queued = self._lanes[lane]
                if not queued:
                    del self._lanes[lane]
                    return
                fd = queued.popleft()
            with contextlib.suppress(OSError):  # a flush error: the descriptor is gone anyway
                os.close(fd)

    @property
    def lanes(self) -> int:
        """Lanes with a close queued or under way (a hung one stays)."""
        with self._lock:
            return len(self._lanes)
