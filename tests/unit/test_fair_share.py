"""Fair share between users: order, caps, stuck operations, preemption, with a given clock."""

from __future__ import annotations

from spanwarm.daemon.fair_share import OVERTIME_SECONDS, USAGE_HALF_LIFE, FairShare


def _share(workers: int = 2, cap: int | None = 1) -> FairShare:
    return FairShare(
        workers, stuck_seconds=30.0, user_max_in_flight=cap, trusted_uids=frozenset({0})
    )


def test_the_user_served_least_lately_goes_first() -> None:
    share = _share()
    op = share.start(1000, now=0.0)
    share.finish(op, now=4.0, served=4.0)
    op = share.start(1001, now=4.0)
    share.finish(op, now=5.0, served=1.0)
    assert share.order([1000, 1001, 1002], now=5.0) == [1002, 1001, 1000]
    # Service decays: by half every USAGE_HALF_LIFE seconds.
    later = 5.0 + 2 * USAGE_HALF_LIFE
    served = share.served(later)
    assert abs(served[1000] - 4.0 * 0.5 ** ((later - 4.0) / USAGE_HALF_LIFE)) < 1e-9
    assert abs(served[1001] - 0.25) < 1e-9


def test_running_operations_count_as_service_while_they_run() -> None:
    share = _share()
    share.start(1000, now=0.0)
    assert share.order([1000, 1001], now=3.0) == [1001, 1000]
    assert share.served(3.0)[1000] == 3.0


def test_a_user_is_held_to_its_cap_but_root_is_not() -> None:
    share = _share(workers=4, cap=1)
    share.start(1000, now=0.0)
    assert not share.may_start(1000, now=0.0)
    assert share.may_start(1001, now=0.0)
    share.start(0, now=0.0)
    assert share.may_start(0, now=0.0)  # trusted: up to every worker
    assert share.in_flight_cap(0) == 4
    assert share.in_flight_cap(1000) == 1


def test_stuck_operations_free_their_workers_but_not_for_their_user() -> None:
    share = _share(workers=1, cap=1)
    share.start(1000, now=0.0)
    assert not share.free_worker(now=1.0)
    assert share.free_worker(now=31.0)  # stuck past stuck_seconds: a worker for others
    assert not share.may_start(1000, now=31.0)  # as many stuck as it may have in flight


def test_heavier_users_make_way_when_every_worker_is_busy() -> None:
    share = _share(workers=2, cap=None)
    share.start(1000, now=0.0)
    share.start(1000, now=0.0)
    # 1001 has cells waiting and was served less: 1000 stops at its next piece.
    assert share.to_preempt({1000: 10, 1001: 3}, now=1.0) == frozenset({1000})
    # Not when a worker is free, nor when only one user has work.
    assert share.to_preempt({1000: 10}, now=1.0) == frozenset()
    share.unservable.add(1001)  # nothing it could be given: no reason to stop 1000
    assert share.to_preempt({1000: 10, 1001: 3}, now=1.0) == frozenset()


def test_an_operation_asked_to_make_way_frees_its_worker_after_overtime() -> None:
    share = _share(workers=1, cap=None)
    share.start(1000, now=0.0)
    share.preempt = frozenset({1000})
    assert not share.free_worker(now=OVERTIME_SECONDS / 2)
    assert share.free_worker(now=OVERTIME_SECONDS + 0.1)


def test_finish_gives_back_the_operation_and_turns_restart() -> None:
    share = _share()
    op = share.start(1000, now=0.0)
    assert (share.running, share.in_flight) == (True, 1)
    assert share.user_in_flight[1000] == 1
    share.finish(op, now=1.0)  # failed before it read: no service charged
    assert (share.running, share.in_flight) == (False, 0)
    assert 1000 not in share.user_in_flight
    assert share.served(1.0)[1000] == 0.0
    share.took_turn(1000, 3)
    assert share.turn(1000) == 3
    share.user_gone(1000)
    assert share.turn(1000) == 0


def test_users_long_gone_are_forgotten() -> None:
    share = _share()
    for uid in range(10):
        share.finish(share.start(uid, now=0.0), now=0.0, served=1.0)
    share.forget_idle(now=20 * USAGE_HALF_LIFE, keep=5)
    assert dict(share.served(20 * USAGE_HALF_LIFE)) == {}
