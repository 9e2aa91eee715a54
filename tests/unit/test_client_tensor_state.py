"""A request's tensor states: each moves once, from PENDING, and the counts add up."""

from __future__ import annotations

import pytest

from spanwarm.client.tensor_state import Progress, TensorState, TensorStates


def test_a_tensor_moves_once_and_the_first_word_stands() -> None:
    states = TensorStates(3)
    assert [states[i] for i in range(3)] == [TensorState.PENDING] * 3
    assert states.pending == 3
    assert states.settle([0, 2], TensorState.READY) == [0, 2]
    # The watchdog's release, then a late "failed" for the same tensor: nothing moves.
    assert states.settle([2, 1], TensorState.FAILED) == [1]
    assert states.settle([0, 1, 2], TensorState.READ_FIRST) == []
    assert [states[i] for i in range(3)] == [
        TensorState.READY,
        TensorState.FAILED,
        TensorState.READY,
    ]
    assert states.pending == 0


def test_numbers_outside_the_request_are_ignored() -> None:
    """They come from the daemon's events: a rank does not fail on a bad one."""
    states = TensorStates(2)
    assert states.settle([-1, 2, 99, 1], TensorState.READY) == [1]
    assert states.pending == 1


def test_nothing_moves_back_to_pending() -> None:
    states = TensorStates(1)
    with pytest.raises(ValueError, match="PENDING"):
        states.settle([0], TensorState.PENDING)
    assert states.pending == 1


def test_a_state_given_as_its_number_is_that_state() -> None:
    states = TensorStates(1)
    assert states.settle([0], 1) == [0]  # type: ignore[arg-type]
    assert states[0] is TensorState.READY


def test_release_lets_go_of_what_is_pending_only() -> None:
    states = TensorStates(4)
    states.settle([0], TensorState.RESIDENT)
    states.settle([1], TensorState.OWN)
    assert states.release() == 2
    assert [states[i] for i in range(4)] == [
        TensorState.RESIDENT,
        TensorState.OWN,
        TensorState.RELEASED,
        TensorState.RELEASED,
    ]
    assert states.release() == 0  # twice: nothing left


def test_tensors_never_asked_for_are_not_reported_read() -> None:
    asked = {state for state in TensorState if state.asked_for}
    assert asked == set(TensorState) - {TensorState.RESIDENT, TensorState.OWN}


def test_progress_counts_each_final_state_and_the_ready_bytes() -> None:
    states = TensorStates(7)
    for i, state in enumerate(
        [
            TensorState.READY,
            TensorState.READY,
            TensorState.FAILED,
            TensorState.RELEASED,
            TensorState.RESIDENT,
            TensorState.READ_FIRST,
        ]
    ):
        states.settle([i], state)
    nbytes = [10, 20, 30, 40, 50, 60, 70]
    progress = states.progress(nbytes)
    assert progress == Progress(
        groups=7,
        ready=2,
        failed=2,  # could not be warmed, or released
        bytes_total=280,
        bytes_ready=30,
        resident=1,
        read=1,
        own=0,
    )
    assert not progress.done  # one is still pending
    states.settle([6], TensorState.OWN)
    assert states.progress(nbytes).done
    assert states.count(TensorState.OWN, TensorState.RESIDENT) == 2


def test_any_pending_looks_at_the_tensors_named_or_all() -> None:
    states = TensorStates(3)
    states.settle([0, 1], TensorState.READY)
    assert states.any_pending()
    assert not states.any_pending([0, 1])
    assert states.any_pending([1, 2])
    assert not states.any_pending([])
    states.release()
    assert not states.any_pending()
