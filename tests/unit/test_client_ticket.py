"""A ticket alone: what a loader sees as the request's tensors settle (no daemon).

The ticket's own thread would settle tensors from the daemon's events; here the test
does, through the same calls, and the loader's side is the public API.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import numpy as np

from spanwarm.client.inline_residency import TensorEnvelopes
from spanwarm.client.read_policy import WORTH_WAITING_S
from spanwarm.client.tensor_state import TensorState
from spanwarm.client.ticket import Ticket, index_read_bytes
from spanwarm.rpc.v1 import warmer_pb2

MiB = 2**20


def test_a_loader_waits_until_the_daemon_says_ready() -> None:
    ticket = Ticket(["a", "b"], [MiB, MiB])
    assert ticket.wait(["not-asked-for"], timeout=0)  # nothing to wait for
    assert not ticket.wait(["a"], timeout=0.01)
    assert not ticket.ready("a")
    threading.Timer(0.05, ticket._mark, args=([0], TensorState.READY)).start()
    assert ticket.wait(["a"], timeout=30)
    assert ticket.ready("a")
    assert not ticket.ready("b")
    progress = ticket.progress
    assert (progress.ready, progress.bytes_ready, progress.done) == (1, MiB, False)


def test_with_no_estimate_wait_for_read_waits_like_wait() -> None:
    ticket = Ticket(["a"], [MiB])
    assert ticket.wait_for_read("a", timeout=0.02) == "timeout"
    assert ticket.wait_for_read("elsewhere") == "ready"
    ticket._mark([0], TensorState.READY)
    assert ticket.wait_for_read("a", timeout=0.02) == "ready"


def test_a_tensor_read_sooner_than_waited_for_is_read_and_reported_read_first() -> None:
    ticket = Ticket(["a", "b"], [MiB, MiB])
    ticket._read_yourself_s = np.array([WORTH_WAITING_S / 2, np.inf])
    assert ticket.wait_for_read("a") == "read"
    ticket.consumed(["a"])  # read before it was warm: nobody waits for it any more
    assert ticket.ready("a")
    assert ticket.progress.read == 1
    ticket._mark([0], TensorState.READY)  # a late "ready" changes nothing
    assert ticket.progress.read == 1
    assert ticket.progress.ready == 0


def test_the_plans_rates_bound_waits_by_the_cold_read() -> None:
    ticket = Ticket(["a", "b"], [4 * MiB, 16 * MiB])
    request = warmer_pb2.WarmRequest(
        files=["/x", "/y"],
        file_index=[0, 1],
        offset=[0, 0],
        length=[4 * MiB, 16 * MiB],
        stride=[4 * MiB, 16 * MiB],
        count=[1, 1],
        group_index=[0, 1],
    )
    index_read_bytes(ticket, request)
    plan = [
        warmer_pb2.FilePlan(path="/x", stream_bytes_per_s=400 * MiB),
        warmer_pb2.FilePlan(path="/y", stream_bytes_per_s=16 * MiB),
    ]
    ticket._learn_read_times(plan, ["/x", "/y"])
    # 4 MiB at 400 MiB/s: 10 ms; 16 MiB at 16 MiB/s: 1 s.
    assert ticket._read_yourself_s.tolist() == [0.01, 1.0]
    began = time.monotonic()
    assert ticket.wait_for_read("a") == "read"  # a bounded wait of 10 ms, then the read
    assert time.monotonic() - began < 5
    assert list(ticket._waits) == [False]
    threading.Timer(0.05, ticket._mark, args=([1], TensorState.READY)).start()
    assert ticket.wait_for_read("b") == "ready"  # warm well within its second
    assert list(ticket._waits) == [False, True]


def test_a_release_lets_every_waiter_go_and_ends_the_request() -> None:
    ticket = Ticket(["a", "b", "c"], [1, 2, 3])
    ticket._mark([2], TensorState.FAILED, "ABORTED: /x changed")
    outcome: list[bool] = []
    waiter = threading.Thread(target=lambda: outcome.append(ticket.wait(timeout=30)))
    waiter.start()
    assert ticket._release() == 2
    waiter.join()
    assert outcome == [True]
    assert ticket.finished.is_set()
    assert ticket.failures == {"c": "ABORTED: /x changed"}
    progress = ticket.progress
    assert (progress.failed, progress.done) == (3, True)
    assert ticket.wait_for_read("a") == "ready"  # read cold, at once
    ticket.consumed(["a"])  # nothing to tell an ended request: no error, no change
    assert ticket.progress.read == 0


def test_reads_reported_before_the_plan_go_out_once_the_daemon_names_the_request() -> None:
    ticket = Ticket(["a", "b", "c"], [1, 1, 1])
    ticket._mark([0], TensorState.READY)
    ticket.consumed(["a", "elsewhere"])
    sent: list[tuple[int, list[int]]] = []
    answered: Future[None] = Future()
    answered.set_result(None)

    def report(request_id: int, groups: list[int]) -> Future[None]:
        sent.append((request_id, groups))
        return answered

    ticket._attach(42, report)
    assert sent == [(42, [0])]
    ticket.consumed(["b"])
    ticket.cancel()  # what is unreported goes first, then the request ends
    assert sent == [(42, [0]), (42, [1])]
    assert ticket.finished.is_set()
    assert ticket.progress.read == 1  # b was read before it was warm


def test_tensors_never_asked_for_are_never_reported() -> None:
    ticket = Ticket(["resident", "own", "asked"], [MiB, MiB, 64 * MiB])
    ticket._cached(0)  # no residency check has begun: nothing to mark
    assert not ticket.ready("resident")
    nothing = np.zeros(0, dtype=np.int64)
    ticket._look_up_from(TensorEnvelopes([], nothing, nothing, nothing, nothing, 3))
    ticket._looked_at(np.array([0, 1, 2]), np.array([0, MiB, 64 * MiB]), np.array([0]))
    ticket._look_up_from(None)  # the check is over
    assert ticket.wait_for_read("resident") == "read"
    ticket._granted(100 * MiB)
    assert not ticket._keep_back(np.array([1, 2]))  # 65 MiB cold: worth asking for
    assert ticket._keep_back(np.array([1]))  # 1 MiB of 66: 10 ms at the grant's rate
    assert ticket.wait_for_read("own") == "read"
    sent: list[list[int]] = []
    done: Future[None] = Future()
    done.set_result(None)

    def report(request_id: int, groups: list[int]) -> Future[None]:
        sent.append(groups)
        return done

    ticket._attach(1, report)
    ticket.consumed(["resident", "own", "asked"])
    ticket.cancel()
    assert sent == [[2]]
    progress = ticket.progress
    assert (progress.resident, progress.own, progress.read) == (1, 1, 1)


def test_the_watchdog_measures_from_the_last_progress_while_tensors_are_pending() -> None:
    ticket = Ticket(["a"], [1])
    time.sleep(0.02)
    assert ticket._stalled_for() >= 0.02
    ticket._heartbeat(10)
    assert ticket._stalled_for() < 0.02
    ticket._mark([0], TensorState.READY)
    assert ticket._stalled_for() == 0.0  # nothing pending: nothing to stall
