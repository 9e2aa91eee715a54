"""Consumed reports: kept until the request is named, then sent in batches on one thread."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Any

from spanwarm.client.reports import ConsumptionReports


class Daemon:
    """What the daemon received: one (request id, tensors) per Consumed call."""

    def __init__(self) -> None:
        self.batches: list[tuple[int, list[int]]] = []
        self.threads: set[str] = set()
        self.arrived = threading.Event()
        self.answer: Future[None] = Future()

    def report(self, request_id: int, groups: list[int]) -> Future[None]:
        self.batches.append((request_id, list(groups)))
        self.threads.add(threading.current_thread().name)
        self.arrived.set()
        return self.answer


def test_reports_before_the_request_is_named_go_out_when_it_is() -> None:
    daemon = Daemon()
    reports = ConsumptionReports(threading.Event())
    reports.add([3, 1])
    reports.add([2])
    assert daemon.batches == []
    assert not reports.sending  # no thread for a request not named yet
    reports.attach(7, daemon.report)
    assert daemon.batches == [(7, [3, 1, 2])]  # at once, on the caller's thread


def test_reports_close_together_go_as_one_batch_on_their_own_thread() -> None:
    daemon = Daemon()
    finished = threading.Event()
    reports = ConsumptionReports(finished, delay=0.5)
    reports.attach(1, daemon.report)
    reports.add([0])
    reports.add([1, 2])  # within the delay of the first: the same batch
    assert daemon.arrived.wait(timeout=30)
    assert daemon.batches == [(1, [0, 1, 2])]
    assert daemon.threads == {"spanwarm-reports"}
    daemon.arrived.clear()
    reports.add([4])  # a later batch, same thread
    assert daemon.arrived.wait(timeout=30)
    assert daemon.batches == [(1, [0, 1, 2]), (1, [4])]
    finished.set()
    reports.end()
    _ended(reports)


def test_a_flush_sends_now_and_may_wait_for_the_answer() -> None:
    daemon = Daemon()
    reports = ConsumptionReports(threading.Event(), delay=60.0)
    reports.attach(5, daemon.report)
    reports.add([9])
    daemon.answer.set_result(None)
    reports.flush(wait=True)
    assert daemon.batches == [(5, [9])]
    reports.flush(wait=True)  # nothing left: nothing sent
    assert daemon.batches == [(5, [9])]


def test_a_report_that_fails_is_dropped_without_an_error() -> None:
    """Sent after the client closed its channel, or to a request already ended: moot."""

    def gone(request_id: int, groups: list[int]) -> Any:
        raise RuntimeError("channel closed")

    late: Future[None] = Future()
    late.set_exception(TimeoutError("no answer"))
    reports = ConsumptionReports(threading.Event(), delay=60.0)
    reports.attach(1, gone)
    reports.add([0])
    reports.flush(wait=True)
    reports.attach(2, lambda request_id, groups: late)
    reports.add([1])
    reports.flush(wait=True)


def test_the_sending_thread_ends_with_the_request() -> None:
    daemon = Daemon()
    finished = threading.Event()
    reports = ConsumptionReports(finished, delay=1.0)
    reports.attach(1, daemon.report)
    reports.add([0])
    assert reports.sending
    finished.set()  # ended while the batch waited: nothing more is sent
    reports.end()
    _ended(reports)
    assert daemon.batches == []


def _ended(reports: ConsumptionReports) -> None:
    deadline = time.monotonic() + 30
    while reports.sending and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not reports.sending
