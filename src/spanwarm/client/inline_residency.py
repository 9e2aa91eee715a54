"""A tensor's residency, looked up on the loader's own thread while the request's check runs.

The ticket's thread checks a request's files in order (:mod:`.residency_check`) and
publishes each tensor once its last file is done. A loader that reaches a tensor before
then would wait for that thread, which shares the interpreter lock with the loader: each
of its system calls gives the lock away, and getting it back can take a switch interval
(5 ms) while the loader copies tensors. So the loader looks the tensor up itself, with
the full check's probe (``residency.probably_cached``: microseconds): cached, it is read
at once; anything else is left to the full check (partly cached tensors get their
page-by-page count there).

Descriptors are opened once per file, on the loader's thread (it is about to open the
file itself: a mount that hangs the open hangs its load the same way), and closed when
the full check is over; a lock keeps a descriptor from being closed, and its number
reused, while a lookup uses it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from spanwarm.pagecache.residency import open_trusted, probably_cached

__all__ = ["TensorEnvelopes"]


class TensorEnvelopes:
    """Each tensor's envelopes (first to last byte per file), for lookups by tensor."""

    def __init__(self, files: list[str], group: Any, file: Any, lo: Any, hi: Any, names: int):
        """``group``, ``file``, ``lo``, ``hi``: one row per envelope, sorted by group."""
        self._files = files
        self._file = file.tolist()
        self._lo = lo.tolist()
        self._hi = hi.tolist()
        self._rows = np.searchsorted(group, np.arange(names + 1)).tolist()
        self._fds: dict[int, int] = {}  # file -> descriptor, or -1: not to be looked at
        self._lock = threading.Lock()
        self._closed = False

    def cached(self, tensor: int, then: Callable[[], None]) -> bool:
        """Whether the tensor's envelopes are in the page cache as far as the probe looks
        (being read in counts: the loader's reads wait for those pages), calling ``then``
        first if so, before :meth:`close` can return: once the full check is over,
        nothing is marked behind its back. False where that cannot be said here: a file
        that will not open, or whose residency this process may not see, or after
        :meth:`close`."""
        with self._lock:
            if self._closed:
                return False
            for row in range(self._rows[tensor], self._rows[tensor + 1]):
                fd = self._open(self._file[row])
                if fd < 0:
                    return False
                probed = probably_cached(fd, self._lo[row : row + 1], self._hi[row : row + 1])
                if probed is None or not probed[0]:
                    return False
            then()
            return True

    def _open(self, position: int) -> int:
        fd = self._fds.get(position)
        if fd is None:
            fd = self._fds[position] = open_trusted(self._files[position])
        return fd

    def close(self) -> None:
        """No more lookups: the full check is over. Closes the descriptors."""
        with self._lock:
            self._closed = True
            fds, self._fds = self._fds, {}
        for fd in fds.values():
            if fd >= 0:
                os.close(fd)
