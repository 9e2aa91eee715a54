"""When a rank waits and when it reads a tensor itself, decided from plain numbers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from spanwarm.client.read_policy import (
    BEHIND_WINDOW,
    DELIVERED_BYTES,
    OWN_BYTES,
    OWN_SAMPLES,
    PIECE_BYTES,
    WORTH_ASKING_S,
    WORTH_WAITING_S,
    ReadPolicy,
    Step,
    plan_rates,
    read_times,
)

MiB = 2**20


def test_with_nothing_known_a_reader_waits_as_for_the_daemon() -> None:
    policy = ReadPolicy([MiB])
    assert policy.bound(0) == math.inf
    assert policy.step(0, began=0.0, limit=math.inf, waited=False, now=0.0) == Step("wait")
    assert policy.step(0, began=0.0, limit=5.0, waited=False, now=1.0) == Step(
        "wait", until=5.0, bounded=False
    )
    assert policy.step(0, began=0.0, limit=5.0, waited=False, now=5.0) == Step("timeout")
    assert not policy.told(0)
    assert list(policy.waits) == []  # an unbounded wait says nothing of the daemon


def test_a_read_sooner_than_a_worthwhile_wait_goes_ahead_at_once() -> None:
    policy = ReadPolicy([MiB, MiB])
    policy.read_yourself_s = np.array([WORTH_WAITING_S / 2, 1.0])
    assert policy.step(0, began=0.0, limit=math.inf, waited=False, now=0.0) == Step("read")
    assert policy.told(0)
    assert not policy.told(1)


def test_a_bounded_wait_ends_with_the_rank_reading_and_that_counts_against_the_daemon() -> None:
    policy = ReadPolicy([MiB])
    policy.read_yourself_s = np.array([0.5])
    first = policy.step(0, began=10.0, limit=math.inf, waited=False, now=10.0)
    assert first == Step("wait", until=10.5, bounded=True)
    assert policy.step(0, began=10.0, limit=math.inf, waited=True, now=10.2).until == 10.5
    assert policy.step(0, began=10.0, limit=math.inf, waited=True, now=10.5) == Step("read")
    assert list(policy.waits) == [False]
    policy.warm_in_time()
    assert list(policy.waits) == [False, True]


def test_a_timeout_before_the_own_read_would_end_is_a_timeout() -> None:
    policy = ReadPolicy([MiB])
    policy.read_yourself_s = np.array([2.0])
    assert policy.step(0, began=0.0, limit=1.0, waited=False, now=0.0) == Step(
        "wait", until=1.0, bounded=True
    )
    assert policy.step(0, began=0.0, limit=1.0, waited=True, now=1.0) == Step("timeout")
    assert list(policy.waits) == []
    assert not policy.told(0)


def test_own_reads_bound_waits_once_enough_are_timed_and_only_lower() -> None:
    tensors = OWN_SAMPLES + 1
    size = OWN_BYTES // OWN_SAMPLES
    policy = ReadPolicy([size] * tensors)
    policy.read_yourself_s = np.full(tensors, 10.0)  # the daemon's figure: slow
    for i in range(OWN_SAMPLES):
        policy.read_yourself_s[i] = 0.001
        assert policy.step(i, began=0.0, limit=math.inf, waited=False, now=0.0) == Step("read")
        assert policy.bound(tensors - 1) == 10.0  # not enough known yet
        policy.took(i, 0.01)
    # 4 MiB in 40 ms: 100 MiB/s; the last tensor (1 MiB) in 10 ms, not 10 s.
    assert policy.bound(tensors - 1) == pytest.approx(0.01)
    # Slower own reads never lengthen a wait: the daemon's figure stays the bound.
    policy.read_yourself_s[tensors - 1] = 0.001
    assert policy.bound(tensors - 1) == 0.001


def test_only_the_share_not_cached_as_the_read_began_counts_as_read() -> None:
    policy = ReadPolicy([OWN_BYTES] * (OWN_SAMPLES + 1))
    policy.read_yourself_s = np.full(OWN_SAMPLES + 1, 0.001)
    for i in range(OWN_SAMPLES):
        policy.step(i, began=0.0, limit=math.inf, waited=False, now=0.0)
        policy.hinted(i, 0.25)  # the daemon had brought three quarters already
        policy.took(i, 0.01)
    policy.read_yourself_s[OWN_SAMPLES] = 100.0
    # 4 x 1 MiB read in 40 ms (100 MiB/s), not 4 x 4 MiB (400 MiB/s): a 4 MiB tensor
    # takes 40 ms, not 10.
    assert policy.bound(OWN_SAMPLES) == pytest.approx(0.04)


def test_a_read_not_told_or_not_timed_is_not_counted() -> None:
    policy = ReadPolicy([OWN_BYTES] * 2)
    policy.took(0, 0.01)  # never told to read it itself
    policy.read_yourself_s = np.array([0.001, 0.001])
    policy.step(1, began=0.0, limit=math.inf, waited=False, now=0.0)
    policy.took(1, 0.0)  # no time: still untimed
    assert policy.told(1)
    assert not policy.told(0)


def test_a_daemon_slower_than_the_rank_is_not_waited_for() -> None:
    policy = ReadPolicy([4 * MiB] * 6)
    policy.read_yourself_s = np.full(6, 0.4)
    policy.warmed([0], now=0.0)  # the first: the pace starts here, its bytes not counted
    assert not policy.daemon_slower(5, 0.4, now=1.0)
    policy.warmed([1, 2], now=1.0)  # 8 MiB in 1 s: known now
    assert policy.daemon_slower(5, 0.4, now=1.0)  # 4 MiB would take it 0.5 s
    assert not policy.daemon_slower(5, 0.6, now=1.0)
    # So a reader of a pending tensor reads at once, no bounded wait first.
    assert policy.step(5, began=1.0, limit=math.inf, waited=False, now=1.0) == Step("read")
    assert list(policy.waits) == []


def test_tensors_the_rank_read_itself_do_not_count_for_the_daemons_pace() -> None:
    policy = ReadPolicy([DELIVERED_BYTES] * 3)
    policy.read_yourself_s = np.full(3, 0.001)
    policy.step(1, began=0.0, limit=math.inf, waited=False, now=0.0)  # told to read it
    policy.warmed([0], now=0.0)
    policy.warmed([1], now=1.0)
    assert not policy.daemon_slower(2, 100.0, now=1.0)  # pace still unknown
    policy.warmed([2], now=1.0)
    assert not policy.daemon_slower(2, 1.1, now=1.0)  # 8 MiB/s: 1 s for 8 MiB


def test_a_daemon_too_often_behind_is_skipped_but_sampled() -> None:
    policy = ReadPolicy([MiB])
    for _ in range(BEHIND_WINDOW // 2 - 1):
        policy.waits.append(False)
    assert not policy.daemon_behind()  # too few waits to tell
    policy.waits.append(False)
    skipped = [policy.daemon_behind() for _ in range(8)]
    assert skipped == [True, True, True, False] * 2  # one wait in four goes ahead
    for _ in range(BEHIND_WINDOW):
        policy.waits.append(True)
    assert not policy.daemon_behind()


def test_a_few_cold_bytes_are_read_here_rather_than_asked_for() -> None:
    policy = ReadPolicy([8 * MiB] * 8)  # 64 MiB asked for
    policy.cached(slice(0, 7))
    policy.missing(np.array([7]), np.array([MiB]))
    assert not policy.keeps_back(np.arange(8))  # nothing known of the mount yet
    policy.granted_rate = 100 * MiB  # 1 MiB: 10 ms
    assert policy.keeps_back(np.arange(8))
    policy.granted_rate = MiB / WORTH_ASKING_S  # 1 MiB takes the whole allowance
    assert not policy.keeps_back(np.arange(8))
    cold = ReadPolicy([8 * MiB, 8 * MiB])  # a quarter cold: more than an eighth
    cold.cached([0])
    cold.missing(np.array([1]), np.array([4 * MiB]))
    cold.granted_rate = 10**12
    assert not cold.keeps_back(np.arange(2))


def test_what_the_residency_check_found_is_the_cold_share() -> None:
    policy = ReadPolicy([4 * MiB, 4 * MiB, 0])
    policy.missing(np.array([0, 1]), np.array([MiB, 8 * MiB]))  # never more than it has
    assert policy.cold_share().tolist() == [0.25, 1.0, 1.0]


def test_read_times_are_the_cold_bytes_at_one_streams_rate_and_a_piece_at_least() -> None:
    rate = np.array([100.0 * MiB, 0.0, 10.0 * MiB])  # per file; the second not known
    file_index = np.array([0, 0, 1, 2, 0])
    group_index = np.array([0, 0, 1, 2, 3])
    nbytes = np.array([50.0 * MiB, 50.0 * MiB, MiB, 4096, 2 * MiB])
    cold = np.array([0.5, 1.0, 1.0, 1.0, 1.0])
    seconds = read_times(rate, file_index, group_index, nbytes, cold, 5)
    assert seconds[0] == pytest.approx(0.5)  # 100 MiB, half of it cold
    assert seconds[1] == math.inf  # its device is not known
    assert seconds[2] == pytest.approx(PIECE_BYTES / (10 * MiB))  # one piece, at least
    assert seconds[3] == pytest.approx(0.02)
    assert seconds[4] == 0.0  # no spans


def test_the_plans_rates_land_on_the_files_as_sent() -> None:
    sent = ["/a", "/b", "/c"]
    in_order = plan_rates([("/a", 1.0), ("/b", 2.0), ("/c", 3.0)], sent)
    assert in_order.tolist() == [1.0, 2.0, 3.0]
    # A file with no plan: the others found by path.
    assert plan_rates([("/c", 3.0), ("/a", 1.0)], sent).tolist() == [1.0, 0.0, 3.0]
    assert plan_rates([("/elsewhere", 5.0)], sent).tolist() == [0.0, 0.0, 0.0]
