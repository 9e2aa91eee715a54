"""The watchdog's measure of progress, and its release of a stalled request."""

from __future__ import annotations

import threading
import time

from spanwarm.client.stall import StallClock, watch


def test_events_and_moving_heartbeats_are_progress_still_ones_are_not() -> None:
    clock = StallClock(now=100.0)
    assert clock.stalled_for(now=103.0) == 3.0
    clock.progressed(now=103.0)
    assert clock.stalled_for(now=104.0) == 1.0
    clock.heartbeat(bytes_done=4096, now=105.0)  # the node read something
    assert clock.stalled_for(now=110.0) == 5.0
    clock.heartbeat(bytes_done=4096, now=110.0)  # alive, but nothing moved
    assert clock.stalled_for(now=112.0) == 7.0
    clock.heartbeat(bytes_done=8192, now=112.0)
    assert clock.stalled_for(now=112.0) == 0.0


def test_a_request_that_finishes_is_not_released() -> None:
    finished = threading.Event()
    finished.set()
    released: list[int] = []

    def release() -> int:
        released.append(1)
        return 1

    assert watch(finished, lambda: 1e9, release, 0.05) is None
    assert released == []


def test_a_stalled_request_is_released_once_the_timeout_passes() -> None:
    finished = threading.Event()
    began = time.monotonic()
    looks: list[float] = []

    def stalled_for() -> float:
        looks.append(time.monotonic())
        return time.monotonic() - began

    def release() -> int:
        finished.set()
        return 3

    outcome = watch(finished, stalled_for, release, stall_timeout=0.2)
    assert outcome is not None
    stalled, released = outcome
    assert stalled >= 0.2
    assert released == 3
    assert len(looks) >= 2  # several looks per timeout, not one at its end


def test_progress_keeps_the_watchdog_waiting() -> None:
    finished = threading.Event()
    clock = StallClock(time.monotonic())
    lock = threading.Lock()

    def stalled_for() -> float:
        with lock:
            return clock.stalled_for(time.monotonic())

    def work() -> None:
        for _ in range(10):  # progress every 50 ms for half a second, against 1 s
            time.sleep(0.05)
            with lock:
                clock.progressed(time.monotonic())
        finished.set()

    worker = threading.Thread(target=work)
    worker.start()
    assert watch(finished, stalled_for, lambda: 0, stall_timeout=1.0) is None
    worker.join()
