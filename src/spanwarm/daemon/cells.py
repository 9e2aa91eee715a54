"""The node's cells: per file and cell, what was warmed (and when), what failed, who waits.

A *cell* is the bytes ``[i*C, (i+1)*C)`` of a file (C = the chunk size, the device
read-ahead window) intersected with the file's plan: the unit of a warm operation.
:class:`CellTable` also keeps, per file, how many planned bytes are warm, counted cell by
cell as records change, so ``Status`` costs the cells that changed since the last one, not
every cell of a load (a daemon may hold a few hundred thousand).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from spanwarm.daemon.ranges import Range, subtract, total, union

__all__ = ["Cell", "CellTable"]

W = TypeVar("W")  # who waits on a cell (the node's requests)
F = TypeVar("F", bound=Hashable)  # a file


@dataclass(slots=True)
class Cell(Generic[W]):
    """One cell's warm history and waiters: a waiter list (rarely more than the node's
    ranks) and no list of failures until a read fails."""

    warm: list[tuple[int, int, float]] = field(default_factory=list)  # (start, stop, completed)
    in_flight: bool = False
    waiters: list[W] = field(default_factory=list)
    bad: tuple[tuple[int, int, float], ...] = ()  # failed reads: (start, stop, when)
    read: bool = False  # a rank reported all its bytes here read (--evict-after-read)
    # --evict-after-read: what the daemon itself brought in from storage here (bytes that
    # were resident before it came are someone else's, and stay).
    fetched: tuple[Range, ...] = ()
    # A rank read its bytes here before they were warm, and the cell was dropped from its
    # request: not warmed in the background either (only a request waiting on it does).
    read_first: bool = False
    counted: int = 0  # its planned warm bytes in its file's total (CellTable)

    def wait(self, waiter: W) -> None:
        if waiter not in self.waiters:
            self.waiters.append(waiter)

    def unwait(self, waiter: W) -> None:
        if waiter in self.waiters:
            self.waiters.remove(waiter)

    def warm_ranges(self) -> list[Range]:
        return union((a, b) for a, b, _ in self.warm)


class CellTable(Generic[F, W]):
    """Every cell the node knows, by file and cell index."""

    def __init__(self) -> None:
        self._files: dict[F, dict[int, Cell[W]]] = {}
        self._warm: dict[F, int] = {}  # planned warm bytes per file, as counted so far
        self._changed: dict[F, set[int]] = {}  # cells whose warm changed since counted
        self._stale: set[F] = set()  # files whose plan changed: count every cell again

    def get(self, key: tuple[F, int]) -> Cell[W] | None:
        cells = self._files.get(key[0])
        return None if cells is None else cells.get(key[1])

    def __getitem__(self, key: tuple[F, int]) -> Cell[W]:
        return self._files[key[0]][key[1]]

    def ensure(self, key: tuple[F, int]) -> Cell[W]:
        """The cell, made empty if the node had none."""
        cells = self._files.setdefault(key[0], {})
        cell = cells.get(key[1])
        if cell is None:
            cell = cells[key[1]] = Cell()
        return cell

    def __len__(self) -> int:
        return sum(len(cells) for cells in self._files.values())

    def keys(self) -> Iterator[tuple[F, int]]:
        for file, cells in self._files.items():
            for index in cells:
                yield file, index

    def add_warm(self, key: tuple[F, int], records: Iterable[tuple[int, int, float]]) -> None:
        """Bytes warmed in the cell: ``(start, stop, completed)``."""
        cell = self.ensure(key)
        cell.warm.extend(records)
        self._changed.setdefault(key[0], set()).add(key[1])

    def clear_warm(self, key: tuple[F, int]) -> None:
        """The cell's warmed bytes were dropped (evicted): none of them counts any more."""
        cell = self.get(key)
        if cell is not None and cell.warm:
            cell.warm.clear()
            self._changed.setdefault(key[0], set()).add(key[1])

    def drop(self, key: tuple[F, int]) -> None:
        cells = self._files.get(key[0])
        if cells is None:
            return
        cell = cells.pop(key[1], None)
        if cell is not None and key[0] in self._warm:
            self._warm[key[0]] -= cell.counted
        if not cells:
            self._forget(key[0])

    def drop_idle(self, files: set[F]) -> None:
        """Forget the cells of ``files`` (nobody needs them any more) but those with an
        operation in flight: it still writes into its cell."""
        for file in files:
            cells = self._files.get(file, {})
            for index in [i for i, c in cells.items() if not c.in_flight]:
                self.drop((file, index))

    def _forget(self, file: F) -> None:
        self._files.pop(file, None)
        self._warm.pop(file, None)
        self._changed.pop(file, None)
        self._stale.discard(file)

    def plan_changed(self, file: F) -> None:
        """The file's plan changed: each cell's planned warm bytes must be counted again."""
        self._stale.add(file)

    def warm_in_plan(self, file: F, planned: Callable[[int], list[Range]]) -> int:
        """Bytes of the file's plan that are warm: ``planned(i)`` is the plan's ranges in
        cell ``i``. Counts only the cells changed since the last call (all of them after
        ``plan_changed``)."""
        cells = self._files.get(file)
        if not cells:
            return 0
        if file in self._stale or file not in self._warm:
            self._stale.discard(file)
            self._changed.pop(file, None)
            count = 0
            for index, cell in cells.items():
                cell.counted = _warm_planned(cell, planned, index)
                count += cell.counted
        else:
            count = self._warm[file]
            for index in self._changed.pop(file, ()):
                changed = cells.get(index)
                if changed is not None:  # (a dropped cell's count went with it)
                    counted = _warm_planned(changed, planned, index)
                    count += counted - changed.counted
                    changed.counted = counted
        self._warm[file] = count
        return count


def _warm_planned(cell: Cell[W], planned: Callable[[int], list[Range]], index: int) -> int:
    if not cell.warm:
        return 0
    warm = cell.warm_ranges()
    return total(warm) - total(subtract(warm, planned(index)))
