"""Descriptors closed off the event loop, in lanes that cannot hold each other up.

A ``close()`` on a FUSE mount waits for its server (``FLUSH``, ``RELEASE``), and a user may
run that server and never answer. With one shared pool of two threads, two such closes
stopped every user's closes for good (an attack run: 160 descriptors of another user
leaked over its next 160 requests). Here each lane has a thread of its own, started when
something is queued in the lane and ended when the lane is empty: a file's lane is its
file system (``("dev", st_dev)``), a refused descriptor's the uid that sent it
(``("uid", uid)``), so a hung file system or a hostile sender holds up only its own
closes. Lanes are bounded: a uid opens at most ``MAX_USER_LANES`` (the lanes of files it
opened first, and its own), past which its closes wait in an overflow lane of its own;
all together at most ``MAX_LANES``, past which a close waits in the shared overflow lane.
A close queued or under way counts against the uid it is charged to (``pending``), so
that a user whose file system never answers cannot grow the daemon's descriptors one
grant at a time: its file caps count them (daemon/access.py).
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
from collections.abc import Hashable

__all__ = ["MAX_LANES", "MAX_USER_LANES", "Closer"]

MAX_LANES = 256
MAX_USER_LANES = 16
_OVERFLOW: Hashable = ("overflow",)


class Closer:
    """Closes descriptors in per-lane daemon threads (thread-safe)."""

    def __init__(self, max_lanes: int = MAX_LANES, max_user_lanes: int = MAX_USER_LANES) -> None:
        self._max_lanes = max_lanes
        self._max_user_lanes = max_user_lanes
        self._lanes: dict[Hashable, collections.deque[tuple[int, int | None]]] = {}
        self._lane_owner: dict[Hashable, int | None] = {}
        self._user_lanes: collections.Counter[int] = collections.Counter()
        self._pending: collections.Counter[int] = collections.Counter()
        self._lock = threading.Lock()

    def close(self, fd: int, lane: Hashable, owner: int | None = None) -> None:
        """Close ``fd`` soon, after the descriptors queued before it in ``lane``; until it
        is closed it counts against uid ``owner`` (None: the daemon's own)."""
        with self._lock:
            new = lane not in self._lanes
            if new and owner is not None and self._user_lanes[owner] >= self._max_user_lanes:
                lane = ("overflow", owner)  # its own: the shared lanes stay for the others
            if lane not in self._lanes and len(self._lanes) >= self._max_lanes:
                lane = _OVERFLOW
            if owner is not None:
                self._pending[owner] += 1
            queued = self._lanes.get(lane)
            if queued is not None:
                queued.append((fd, owner))
                return
            self._lanes[lane] = collections.deque([(fd, owner)])
            self._lane_owner[lane] = owner
            if owner is not None:
                self._user_lanes[owner] += 1
        try:
            threading.Thread(
                target=self._drain, args=(lane,), name="spanwarm-close", daemon=True
            ).start()
        except RuntimeError:  # no thread to be had (a thread limit): close it here
            with self._lock:
                queued = self._lanes[lane]
                left = list(queued)
                queued.clear()
            for fd_left, owner_left in left:
                self._close(fd_left, owner_left)
            self._drain(lane)  # finds the lane empty (or what came meanwhile) and ends it

    def _close(self, fd: int, owner: int | None) -> None:
        with contextlib.suppress(OSError):  # a flush error: the descriptor is gone anyway
            os.close(fd)
        if owner is not None:
            with self._lock:
                self._pending[owner] -= 1
                if self._pending[owner] <= 0:
                    del self._pending[owner]

    def _drain(self, lane: Hashable) -> None:
        while True:
            with self._lock:
                queued = self._lanes[lane]
                if not queued:
                    del self._lanes[lane]
                    owner = self._lane_owner.pop(lane)
                    if owner is not None:
                        self._user_lanes[owner] -= 1
                        if self._user_lanes[owner] <= 0:
                            del self._user_lanes[owner]
                    return
                fd, owner = queued.popleft()
            self._close(fd, owner)

    def pending(self, uid: int) -> int:
        """Descriptors charged to ``uid`` that are queued or being closed."""
        with self._lock:
            return self._pending.get(uid, 0)

    def pending_except(self, uids: frozenset[int]) -> int:
        """Descriptors queued or being closed, charged to any uid but ``uids``."""
        with self._lock:
            return sum(n for uid, n in self._pending.items() if uid not in uids)

    @property
    def lanes(self) -> int:
        """Lanes with a close queued or under way (a hung one stays)."""
        with self._lock:
            return len(self._lanes)
