"""A fixed pool of daemon threads for blocking work that may never return.

``concurrent.futures.ThreadPoolExecutor`` joins its threads at interpreter exit (and
asyncio's default executor is joined when the loop closes), so one storage read hung in
the kernel would hold SIGTERM hostage for as long as the storage likes (118 s measured
with a FUSE read hung 20 s per call). These threads are daemon threads, and
``shutdown(wait=False)`` abandons whatever they are stuck in: the process exits anyway.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

__all__ = ["DaemonThreadPool"]

T = TypeVar("T")

_Item = tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class DaemonThreadPool(Executor):
    """``workers`` daemon threads taking tasks in submission order."""

    def __init__(self, workers: int, name: str, *, nice: int = 0) -> None:
        self._nice = nice
        self._name = name
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
            for i in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    def grow_to(self, workers: int) -> None:
        """Have at least ``workers`` threads (for work that may never return: a thread
        stuck in it is lost, and the pool must still have enough that are not)."""
        with self._lock:
            while len(self._threads) < workers and not self._closed:
                thread = threading.Thread(
                    target=self._work, name=f"{self._name}-{len(self._threads)}", daemon=True
                )
                self._threads.append(thread)
                thread.start()

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        future: Future[T] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot schedule new work after shutdown")
            self._queue.put((future, fn, args, kwargs))
        return future

    def _work(self) -> None:
        if self._nice:  # Linux: a thread's own niceness, so the event loop gets the CPU first
            with contextlib.suppress(OSError):
                tid = threading.get_native_id()
                os.setpriority(
                    os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + self._nice
                )
        while (item := self._queue.get()) is not None:
            future, fn, args, kwargs = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(result)
            del item, future, fn, args, kwargs  # nothing of a finished task stays referenced

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop taking work; queued tasks are cancelled if asked, running ones abandoned
        unless ``wait``."""
        with self._lock:
            self._closed = True
        if cancel_futures:
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[0].cancel()
        for _ in self._threads:
            self._queue.put(None)
        if wait:
            for thread in self._threads:
                thread.join()
