"""The daemon's heap: glibc settings and trims that give a large request's memory back.

A request of a million spans decodes to tens of MB of numpy arrays and temporaries. By
default glibc raises its mmap threshold each time such a block is freed (up to 32 MB), so
later arrays of that size come from the heap, where freed holes keep the daemon's RSS
high for as long as anything above them lives. Fixing the threshold at 128 KiB sends every
large array to its own mapping, returned to the system the moment it is freed; small
objects stay on the heap, trimmed after large requests and large calls
(:class:`HeapTrimmer`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import functools
import gc
from collections.abc import Callable
from typing import Any

__all__ = [
    "LARGE_MESSAGE",
    "LARGE_REQUEST_SPANS",
    "HeapTrimmer",
    "configure_heap",
    "forget_frames",
    "trim_heap",
]

# A message this large has its memory given back when its call ends, however it ends: a
# refusal's exception holds the handler's frame (the raw and the decoded message) in a
# reference cycle that only the collector frees, and a daemon that allocates little
# seldom runs a full collection (without a trim, six refused 104 MB Warms hold 2.7 GB:
# an attack run's figure).
LARGE_MESSAGE = 4 * 2**20  # bytes
LARGE_REQUEST_SPANS = 10_000  # a request this large has its memory given back when done
TRIM_DELAY_S = 0.5  # a call's frame has let go of its objects by then
TRIM_AGAIN_S = 5.0  # grpc has let go of a call's objects by then

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
_MMAP_THRESHOLD = 128 * 2**10

try:
    _libc: Any = ctypes.CDLL(None)
    _mallopt: Any = _libc.mallopt
    _malloc_trim: Any = _libc.malloc_trim
except AttributeError:  # not glibc: its allocator has its own policy
    _mallopt = _malloc_trim = None


def configure_heap() -> bool:
    """Fix glibc's mmap and trim thresholds for this process (once, at start). Returns
    whether they were set (False on other C libraries)."""
    if _mallopt is None:
        return False
    return bool(
        _mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)
        and _mallopt(_M_TRIM_THRESHOLD, 2 * _MMAP_THRESHOLD)
    )


def trim_heap(*, collect: bool) -> None:
    """Give freed heap memory back to the system (a cycle waits for the collector first
    when ``collect``). Takes tens of milliseconds: call it from a worker thread."""
    if collect:
        gc.collect()
    if _malloc_trim is not None:
        _malloc_trim(0)


def forget_frames(exc: BaseException) -> None:
    """Drop the tracebacks of ``exc`` and the exceptions it chains to: they hold the frames
    that raised them, and those the request's messages; the exception itself lives on
    (grpc keeps the abort it leads to, chained to it, for a while after the call)."""
    seen: set[int] = set()
    chained: BaseException | None = exc
    while chained is not None and id(chained) not in seen:
        seen.add(id(chained))
        chained.__traceback__ = None
        chained = chained.__cause__ or chained.__context__


class HeapTrimmer:
    """Collects and trims the heap in ``pool`` (off the event loop: a trim takes tens of
    milliseconds), on the event loop's request. One trim pending at a time; a call that
    ends while one is pending gets one more after it (its garbage may not exist yet when
    the pending one runs). ``trim``: what a trim runs (collect, then trim the heap)."""

    def __init__(
        self,
        pool: concurrent.futures.Executor,
        *,
        trim: Callable[[], object] | None = None,
        delay: float = TRIM_DELAY_S,
        again_after: float = TRIM_AGAIN_S,
    ) -> None:
        self._pool = pool
        self._trim_heap = trim or functools.partial(trim_heap, collect=True)
        self._delay = delay
        self._again_after = again_after
        self._pending = False
        self._again = False

    def after_call(self) -> None:
        """Collect and trim soon after a large call, and once more a while later: grpc lets
        go of a call's objects (and, through its abort, of what they hold) some time after
        the call ends."""
        self.soon()
        with contextlib.suppress(RuntimeError):  # the loop is ending: nothing to trim
            asyncio.get_running_loop().call_later(self._again_after, self.soon)

    def soon(self) -> None:
        """Collect and trim the heap once this call's frame has let go of it."""
        if self._pending:
            self._again = True
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # a stream closed as the loop ends: nothing left to trim
            return
        self._pending = True
        loop.call_later(self._delay, self._trim, loop)

    def _trim(self, loop: asyncio.AbstractEventLoop) -> None:
        again, self._again = self._again, False
        try:
            job = self._pool.submit(self._trim_heap)
        except RuntimeError:  # the pool has shut down: we are exiting
            self._pending = False
            return

        def done() -> None:
            self._pending = False
            if again:
                self.soon()

        def back_on_the_loop(_: object) -> None:
            with contextlib.suppress(RuntimeError):  # the loop has closed: we are exiting
                loop.call_soon_threadsafe(done)

        job.add_done_callback(back_on_the_loop)
