"""The budget in use: held bytes, holders and their expiry, mappings given back."""

from __future__ import annotations

from spanwarm.daemon.holds import Holds


def _holds(budget: int = 100, chunk: int = 10) -> tuple[Holds[str, str], list[tuple[int, int]]]:
    unmapped: list[tuple[int, int]] = []
    return Holds(budget, chunk, unmap=lambda a, n: unmapped.append((a, n))), unmapped


def test_warmed_bytes_count_until_released() -> None:
    holds, unmapped = _holds()
    holds.warmed("c1", 40, [(4096, 40)])
    holds.warmed("c2", 30, [])
    assert holds.held_total == 70
    assert holds.release("c1") == 40
    assert holds.held_total == 30
    assert unmapped == [(4096, 40)]
    assert holds.release("c1") == 0


def test_over_budget_when_one_more_chunk_would_pass_it() -> None:
    holds, _ = _holds(budget=100, chunk=10)
    assert not holds.over_budget()  # nothing committed: one chunk always goes
    holds.warmed("c1", 85, [])
    assert not holds.over_budget()
    holds.in_flight_bytes = 10
    assert holds.over_budget()
    small, _ = _holds(budget=5, chunk=10)
    assert not small.over_budget()


def test_holds_expire_by_when_they_were_taken() -> None:
    holds, _ = _holds()
    holds.hold("c1", "r1", now=1.0)
    holds.hold("c1", "r2", now=5.0)
    holds.hold("c2", "r1", now=2.0)
    assert sorted(holds.expired(deadline=3.0)) == [("c1", "r1"), ("c2", "r1")]
    holds.unhold("c1", "r1")
    holds.unhold("c2", "r1")
    assert holds.held_by_anyone("c1")
    assert not holds.held_by_anyone("c2")


def test_close_gives_back_every_mapping() -> None:
    holds, unmapped = _holds()
    holds.warmed("c1", 10, [(1, 2), (3, 4)])
    holds.warmed("c2", 10, [(5, 6)])
    holds.close()
    assert sorted(unmapped) == [(1, 2), (3, 4), (5, 6)]
