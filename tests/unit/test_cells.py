"""The node's cell table: waiters, warm records, and the per-file count Status reads."""

from __future__ import annotations

from spanwarm.daemon.cells import CellTable
from spanwarm.daemon.ranges import Range, clip

CHUNK = 100


def _planned(runs: list[Range]):  # type: ignore[no-untyped-def]
    """The plan's runs in cell i, as NodePlans.planned gives them."""
    return lambda i: clip(runs, i * CHUNK, (i + 1) * CHUNK)


def test_a_waiter_is_listed_once_and_removed() -> None:
    table: CellTable[str, str] = CellTable()
    cell = table.ensure(("f", 0))
    cell.wait("r1")
    cell.wait("r1")
    cell.wait("r2")
    assert cell.waiters == ["r1", "r2"]
    cell.unwait("r1")
    cell.unwait("r1")
    assert cell.waiters == ["r2"]
    assert table.ensure(("f", 0)) is cell
    assert table.get(("f", 1)) is None
    assert table.get(("g", 0)) is None


def test_warm_in_plan_counts_only_planned_warm_bytes() -> None:
    table: CellTable[str, str] = CellTable()
    planned = _planned([(10, 50), (120, 180)])
    table.add_warm(("f", 0), [(0, 30, 1.0), (20, 40, 2.0)])  # 10..40 of the plan's 10..50
    table.add_warm(("f", 1), [(100, 150, 1.0)])  # 120..150 planned
    assert table.warm_in_plan("f", planned) == 30 + 30


def test_warm_in_plan_follows_new_warm_drops_and_evictions() -> None:
    table: CellTable[str, str] = CellTable()
    planned = _planned([(0, 300)])
    table.add_warm(("f", 0), [(0, 100, 1.0)])
    assert table.warm_in_plan("f", planned) == 100
    table.add_warm(("f", 1), [(100, 150, 1.0)])
    table.add_warm(("f", 0), [(50, 100, 2.0)])  # again: counted once
    assert table.warm_in_plan("f", planned) == 150
    table.clear_warm(("f", 0))
    assert table.warm_in_plan("f", planned) == 50
    table.drop(("f", 1))
    assert table.warm_in_plan("f", planned) == 0
    assert table.get(("f", 1)) is None


def test_a_new_plan_counts_every_cell_again() -> None:
    table: CellTable[str, str] = CellTable()
    table.add_warm(("f", 0), [(0, 100, 1.0)])
    table.add_warm(("f", 2), [(200, 300, 1.0)])
    assert table.warm_in_plan("f", _planned([(0, 300)])) == 200
    narrower = _planned([(0, 10), (290, 300)])
    assert table.warm_in_plan("f", narrower) == 200  # not told: the count stands
    table.plan_changed("f")
    assert table.warm_in_plan("f", narrower) == 20


def test_drop_idle_keeps_cells_in_flight() -> None:
    table: CellTable[str, str] = CellTable()
    table.ensure(("f", 0)).in_flight = True
    table.ensure(("f", 1))
    table.ensure(("g", 0))
    table.drop_idle({"f"})
    assert sorted(table.keys()) == [("f", 0), ("g", 0)]
    table.ensure(("f", 0)).in_flight = False
    table.drop_idle({"f", "g"})
    assert len(table) == 0
