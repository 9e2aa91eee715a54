"""Consumed reports: which tensors a rank has read, sent to the daemon in batches.

Under a memory budget the daemon moves on once tensors are read, and one read before it
was warm is warmed no longer for this request; so the rank tells it. A loader of many
small tensors would spend a gRPC call on each, on cores the load needs: reports wait up
to :data:`REPORT_DELAY` for more and go as one call, from a thread of their own (one per
load, not one per batch). Until the daemon has named the request (its plan), reports are
kept, and go out as soon as it has.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["REPORT_DELAY", "ConsumptionReports", "Report"]

logger = logging.getLogger("spanwarm.client")

REPORT_DELAY = 0.01  # consumption reports are batched over this many seconds

Report = Callable[[int, list[int]], Any]
"""Sends one batch: (request id, tensor numbers) -> a future (``result(timeout)``)."""


class ConsumptionReports:
    """One request's reports of tensors read. The thread that sends them ends once
    ``finished`` is set (the request is over: reports would find no request) and
    :meth:`end` wakes it."""

    def __init__(self, finished: threading.Event, *, delay: float = REPORT_DELAY) -> None:
        self._finished = finished
        self._delay = delay
        self._lock = threading.Lock()
        self._unreported: list[int] = []
        self._request_id: int | None = None
        self._report: Report | None = None
        self._flushing = False  # a batch is due
        self._due = threading.Event()  # wakes the sending thread
        self._thread: threading.Thread | None = None

    def add(self, tensors: Iterable[int]) -> None:
        """Report ``tensors`` read: sent within :data:`REPORT_DELAY` once the request has
        been named, else with the first batch after."""
        with self._lock:
            self._unreported.extend(tensors)
            due = not (self._request_id is None or self._report is None or self._flushing)
            if due:  # else sent once the request is named, or with the batch already due
                self._flushing = True
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._send, name="spanwarm-reports", daemon=True
                    )
                    self._thread.start()
        if due:
            self._due.set()

    def attach(self, request_id: int, report: Report) -> None:
        """The daemon named the request ``request_id``; ``report`` sends a batch. What
        was reported before goes now."""
        with self._lock:
            self._request_id, self._report = request_id, report
            backlog, self._unreported = self._unreported, []
        if backlog:
            report(request_id, backlog)

    def flush(self, wait: bool = False) -> None:
        """Send what is unreported now (``wait``: and wait for it, briefly). Any error
        only means the report is moot: the client was closed, the channel is gone."""
        with self._lock:
            self._flushing = False
            batch, self._unreported = self._unreported, []
            request_id, report = self._request_id, self._report
        if batch and request_id is not None and report is not None:
            try:
                sent = report(request_id, batch)
                if wait:
                    sent.result(timeout=1.0)
            except Exception as exc:
                logger.debug("spanwarm: Consumed not sent: %s", exc)

    def end(self) -> None:
        """The request is over (``finished`` is set): the sending thread, if any, ends."""
        self._due.set()

    @property
    def sending(self) -> bool:
        """Whether the sending thread is running."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    def _send(self) -> None:
        """Send each batch :data:`REPORT_DELAY` after its first report, until the end."""
        while True:
            self._due.wait()
            if self._finished.is_set():
                return
            time.sleep(self._delay)
            self._due.clear()
            if self._finished.is_set():
                # Ended during the sleep: its wake-up was just cleared, and no other
                # comes (the thread would wait for good, holding the ticket).
                return
            self.flush()
