"""A rank's Warm request as the node tracks it: per cell it touches, the hull of its bytes
there and the tensor groups waiting for it; per group, readiness and consumption.

Per-cell state is kept in flat arrays (CSR-style, rows = cells touched), so a request of
a million spans costs a few hundred bytes per cell, not a Python object per span.
"""

from __future__ import annotations

import asyncio
import bisect
import enum
import itertools
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from spanwarm.checkpoint.spans import SpanTable, run_offsets
from spanwarm.daemon.admission import AdmittedRequest
from spanwarm.daemon.files import OpenFile
from spanwarm.daemon.ranges import Range

__all__ = [
    "FAILED",
    "PENDING",
    "READY",
    "CellIndex",
    "CellKey",
    "CellQueue",
    "Event",
    "EventKind",
    "Range",
    "Request",
    "index_cells",
]

CellKey = tuple[OpenFile, int]

PENDING, READY, FAILED = 0, 1, 2


class EventKind(enum.StrEnum):
    """What an event of a request's stream says: groups became ready, groups failed (with
    a code and a reason), or nothing of the request is pending any more."""

    READY = "ready"
    FAILED = "failed"
    DONE = "done"


@dataclass(frozen=True)
class Event:
    """One message for a request's stream."""

    kind: EventKind
    groups: tuple[int, ...] = ()
    code: str = ""
    reason: str = ""


_PAIRS_PER_BATCH = 1 << 20  # (span, cell) pairs expanded at once: bounds the temporaries


def _touches(
    table: SpanTable, groups: npt.NDArray[np.int64], size: int, chunk: int, file_id: int
) -> list[tuple[npt.NDArray[np.int64], ...]]:
    """Every (file, cell, lo, hi, group) where a span has bytes in a cell: [lo, hi) is the
    hull of that span's rows inside the cell. Expanded in batches of about
    ``_PAIRS_PER_BATCH`` pairs, so the temporaries stay small whatever the spans."""
    keep = (table.length > 0) & (table.count > 0)
    span_ids = np.flatnonzero(keep)
    off, length = table.offset[keep], table.length[keep]
    stride = np.where(table.stride[keep] > 0, table.stride[keep], 1)
    count = np.where(table.stride[keep] > 0, table.count[keep], 1)
    end = off + (count - 1) * stride + length
    first_cell, last_cell = off // chunk, (end - 1) // chunk
    cells_per_span = last_cell - first_cell + 1
    bounds = np.searchsorted(
        np.cumsum(cells_per_span),
        np.arange(_PAIRS_PER_BATCH, int(cells_per_span.sum()), _PAIRS_PER_BATCH),
        side="right",
    )
    out: list[tuple[npt.NDArray[np.int64], ...]] = []
    for part in np.split(np.arange(len(off)), bounds):
        if not part.size:
            continue
        per = cells_per_span[part]
        pair = np.repeat(part, per)
        cell = np.repeat(first_cell[part], per) + run_offsets(per)
        o, ln, st, ct = off[pair], length[pair], stride[pair], count[pair]
        c0 = cell * chunk
        c1 = np.minimum(c0 + chunk, size)
        first_row = np.maximum(0, (c0 - o - ln) // st + 1)  # first row ending past c0
        last_row = np.minimum(ct - 1, (c1 - 1 - o) // st)  # last row starting before c1
        hit = first_row <= last_row
        lo = np.maximum(c0, o + first_row * st)[hit]
        hi = np.minimum(c1, o + last_row * st + ln)[hit]
        span = span_ids[pair[hit]]
        out.append((np.full(len(span), file_id, np.int64), cell[hit], lo, hi, groups[span]))
    return out


@dataclass
class CellIndex:
    """A request's spans indexed by the cells they touch: per cell (a *row*, sorted by file
    and cell) the hull of its bytes there and the groups waiting for it (CSR), and per
    group its rows (inverse CSR). Plain arrays: built in a helper process for a large
    request."""

    group_bytes: npt.NDArray[np.int64]  # bytes each group names
    rows: int  # strided rows in all (what planning expands: --user-max-rows)
    hull_lo: npt.NDArray[np.int64]
    hull_hi: npt.NDArray[np.int64]
    group_flat: npt.NDArray[np.int32]  # each row's groups, row after row
    group_ptr: npt.NDArray[np.int64]  # row r's groups: group_flat[group_ptr[r]:group_ptr[r + 1]]
    remaining: npt.NDArray[np.int64]  # rows each group waits for
    unread: npt.NDArray[np.int64]  # groups each row waits to see consumed
    rows_by_group: npt.NDArray[np.int64]
    rows_ptr: npt.NDArray[np.int64]  # group g's rows: rows_by_group[rows_ptr[g]:rows_ptr[g + 1]]
    row_cell: npt.NDArray[np.int64]
    file_rows: list[int]  # file i's rows: file_rows[i]:file_rows[i + 1]
    queue_order: npt.NDArray[np.int64]  # rows in the order of their first groups


def index_cells(
    tables: list[SpanTable],
    span_groups: list[npt.NDArray[np.int64]],
    sizes: list[int],
    groups: int,
    chunk: int,
) -> CellIndex:
    """Index the spans of a request's distinct files (``tables[i]`` in a file of
    ``sizes[i]`` bytes, each span's group in ``span_groups[i]``) by ``chunk``-byte cell."""
    group_bytes = np.zeros(groups, dtype=np.int64)
    rows = 0
    parts = []
    for i, (table, group_of) in enumerate(zip(tables, span_groups, strict=True)):
        np.add.at(group_bytes, group_of, table.length * table.count)
        rows += int(table.count[table.count > 1].sum())
        parts.extend(_touches(table, group_of, sizes[i], chunk, i))
    file_id, cell, lo, hi, group = (
        np.concatenate([p[i] for p in parts]) if parts else np.zeros(0, np.int64) for i in range(5)
    )
    order = np.lexsort((group, cell, file_id))
    file_id, cell, lo, hi, group = (a[order] for a in (file_id, cell, lo, hi, group))
    new_row = np.ones(len(cell), dtype=bool)
    new_row[1:] = (cell[1:] != cell[:-1]) | (file_id[1:] != file_id[:-1])
    heads = np.flatnonzero(new_row)
    if len(heads):
        hull_lo = np.minimum.reduceat(lo, heads)
        hull_hi = np.maximum.reduceat(hi, heads)
        # A row comes when its first group does: groups are numbered in the order the
        # rank reads them (the wire contract), across all its files. (A span's index in
        # its own file would put every file's first cell before any second one.)
        first_group = group[heads]  # each row's groups are sorted
    else:
        hull_lo = hull_hi = first_group = np.zeros(0, np.int64)
    distinct = new_row.copy()
    distinct[1:] |= group[1:] != group[:-1]
    row_of_pair = np.cumsum(new_row) - 1
    group_flat = group[distinct].astype(np.int32)
    group_ptr = np.searchsorted(row_of_pair[distinct], np.arange(len(heads) + 1))
    remaining = np.zeros(groups, dtype=np.int64)
    np.add.at(remaining, group_flat, 1)
    # Consumption: groups left unread per row, and each group's rows (inverse CSR).
    per_row = np.diff(group_ptr)
    row_of_entry = np.repeat(np.arange(len(per_row)), per_row)
    by_group = np.argsort(group_flat, kind="stable")
    return CellIndex(
        group_bytes=group_bytes,
        rows=rows,
        hull_lo=hull_lo,
        hull_hi=hull_hi,
        group_flat=group_flat,
        group_ptr=group_ptr,
        remaining=remaining,
        unread=per_row.astype(np.int64),
        rows_by_group=row_of_entry[by_group],
        rows_ptr=np.searchsorted(group_flat[by_group], np.arange(groups + 1)),
        row_cell=cell[heads],
        file_rows=np.searchsorted(file_id[heads], np.arange(len(tables) + 1)).tolist(),
        # Rows in the order of their first groups (a group's rows in file order); rows no
        # longer pending are passed over.
        queue_order=np.argsort(first_group, kind="stable"),
    )


class Request:
    """A rank's live interest: its spans, what each group waits for, its event queue.

    Per cell it touches (a *row*): the hull of its bytes there, and the groups waiting
    for it (flat arrays, CSR-style: a million spans stay a few hundred bytes each).
    """

    _ids = itertools.count(1)

    def name_of(self, file: OpenFile) -> str:
        return self.names.get(file, file.path)

    def __init__(
        self,
        admitted: AdmittedRequest,
        chunk: int,
        index: Callable[..., CellIndex] = index_cells,
    ) -> None:
        """``index``: ``index_cells``, or what runs it elsewhere (a helper process)."""
        self.id = next(self._ids)
        self.uid = os.geteuid()  # who asked (the service sets it from the caller's grant)
        self.token = ""  # the grant token its Warm call spent ("" when opened by name)
        self.job = admitted.job
        self.rank = admitted.rank
        self.groups = admitted.groups
        self.arrival = time.monotonic()
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.files: dict[OpenFile, SpanTable] = {}
        self.file_groups: dict[OpenFile, npt.NDArray[np.int64]] = {}  # group of each span
        self.active = False  # in the node plan and in its cells' waiters (Node.register)
        self.activated = float("inf")  # when it became active
        self.acquired = list(admitted.files)  # one file-table reference per listed path
        self.released = False  # Node.release has given back its files and interest
        # What this caller is shown for each file: its own name for it (a shared file's
        # path is whoever opened it first).
        self.names: dict[OpenFile, str] = {}
        for file, name in zip(admitted.files, admitted.names, strict=True):
            self.names.setdefault(file, name)
        self.state = np.zeros(len(self.groups), dtype=np.int8)
        self.finished = False
        for file, table, groups in zip(
            admitted.files,
            (admitted.spans[i] for i in range(len(admitted.files))),
            (admitted.span_groups[i] for i in range(len(admitted.files))),
            strict=True,
        ):
            if file in self.files:  # one file under two names
                self.files[file] = SpanTable.concat([self.files[file], table])
                self.file_groups[file] = np.concatenate([self.file_groups[file], groups])
            else:
                self.files[file], self.file_groups[file] = table, groups
        files = list(self.files)
        cells = index(
            [self.files[f] for f in files],
            [self.file_groups[f] for f in files],
            [f.size for f in files],
            len(self.groups),
            chunk,
        )
        self.group_bytes = cells.group_bytes
        self._nbytes = int(self.group_bytes.sum())  # asked for by every Status and cap check
        self.rows = cells.rows  # of its strided spans: what planning expands (--user-max-rows)
        self.hull_lo, self.hull_hi = cells.hull_lo, cells.hull_hi
        self._group_flat, self._group_ptr = cells.group_flat, cells.group_ptr
        self.remaining = cells.remaining
        self._unread = cells.unread
        self._rows_by_group, self._rows_ptr = cells.rows_by_group, cells.rows_ptr
        self.consumed = np.zeros(len(self.groups), dtype=bool)
        self.read_first = False  # the last consume() took a group not yet ready
        self.holding: set[CellKey] = set()  # warmed for it, not yet reported read
        self.unheld = asyncio.Event()  # set while it holds nothing: its stream may end
        self.unheld.set()
        # Rows are sorted by (file, cell): a cell's row is a binary search in its file's
        # slice, so no Python object per row (a dict and a set of tuples cost ~200 B/row).
        self._files = files
        self._file_index = {file: i for i, file in enumerate(files)}
        self._row_cell = cells.row_cell
        self._file_rows: list[int] = cells.file_rows
        self._file_starts = self._file_rows[:-1]
        self.pending = _RowSet(self)
        self.queue = CellQueue(cells.queue_order, self.key_of, self.pending.flags)

    def row_of(self, key: CellKey) -> int | None:
        """The row of a cell this request touches (None when it touches no byte there)."""
        index = self._file_index.get(key[0])
        if index is None:
            return None
        start, stop = self._file_rows[index], self._file_rows[index + 1]
        # bisect on the array: a third of np.searchsorted's cost on a slice (per dispatch)
        row = bisect.bisect_left(self._row_cell, key[1], start, stop)
        return row if row < stop and self._row_cell[row] == key[1] else None

    def key_of(self, row: int) -> CellKey:
        # bisect on a list: a numpy call costs microseconds, and this runs per dispatch
        index = bisect.bisect_right(self._file_starts, row) - 1
        return self._files[index], int(self._row_cell[row])

    @property
    def cells(self) -> Iterator[CellKey]:
        """Every cell it touches, in file order (built on the fly)."""
        for index, file in enumerate(self._files):
            start, stop = self._file_rows[index], self._file_rows[index + 1]
            for cell in self._row_cell[start:stop].tolist():
                yield file, cell

    def rows_in(self, file: OpenFile) -> npt.NDArray[np.int64]:
        """Its rows in one file."""
        index = self._file_index.get(file)
        if index is None:
            return np.zeros(0, np.int64)
        return np.arange(self._file_rows[index], self._file_rows[index + 1])

    def consume(self, groups: Iterable[int]) -> list[CellKey]:
        """Mark groups read; return the cells in which nothing of this request is left
        unread. Vectorised: a report of a million groups costs milliseconds, not seconds
        of the event loop (indices outside the request and repeats are ignored)."""
        wanted = (
            groups.astype(np.int64, copy=False)
            if isinstance(groups, np.ndarray)
            else np.fromiter(groups, dtype=np.int64)
        )
        wanted = np.unique(wanted[(wanted >= 0) & (wanted < len(self.groups))])
        wanted = wanted[~self.consumed[wanted]]
        self.read_first = False
        if not wanted.size:
            return []
        # Only a group read before it was ready can end the request (Node.consumed): so
        # that is checked per report's groups, not over all of them.
        self.read_first = bool((self.state[wanted] == PENDING).any())
        self.consumed[wanted] = True
        starts, stops = self._rows_ptr[wanted], self._rows_ptr[wanted + 1]
        per = stops - starts
        rows = self._rows_by_group[np.repeat(starts, per) + run_offsets(per)]
        np.subtract.at(self._unread, rows, 1)
        touched = np.unique(rows)
        return [self.key_of(int(row)) for row in touched[self._unread[touched] == 0]]

    def unread_in(self, key: CellKey) -> bool:
        """Whether some group of this request with bytes in the cell is not reported read."""
        row = self.row_of(key)
        return row is not None and bool(self._unread[row] > 0)

    def groups_touching(self, file: OpenFile, start: int, stop: int) -> npt.NDArray[np.int64]:
        """The groups with a byte in ``[start, stop)`` of ``file`` (exact, row by row)."""
        t = self.files[file]
        first_row = np.maximum(0, (start - t.offset - t.length) // t.stride + 1)  # ends > start
        hit = (first_row < t.count) & (t.offset + first_row * t.stride < stop)
        return np.unique(self.file_groups[file][hit])

    def group_cells(self, group: int) -> list[CellKey]:
        """The cells the group's spans touch, in file order."""
        rows = self._rows_by_group[self._rows_ptr[group] : self._rows_ptr[group + 1]]
        return [self.key_of(int(row)) for row in rows]

    def serves_group(self, key: CellKey, group: int) -> bool:
        return bool((self.cell_groups(key) == group).any())

    def may_exceed_budget(self, key: CellKey) -> bool:
        """Whether the cell may be warmed past the budget: it serves this request's first
        tensor not yet ready, and the request holds nothing it could read before that
        tensor. A rank that has read everything warmed for it is waiting on exactly this:
        without it, nothing would ever be read and released. A rank still holding unread
        tensors it can read now waits; held cells whose unread tensors all come after the
        first pending one cannot be read before it, so they do not hold it back."""
        pending = np.flatnonzero(self.waiting)
        if not pending.size:
            return False
        first = int(pending[0])
        if not bool((self.cell_groups(key) == first).any()):
            return False
        for held in self.holding:
            groups = self.cell_groups(held)
            unread = groups[~self.consumed[groups]]
            if not ((unread == first).any() or (unread > first).all()):
                return False
        return True

    def hull(self, key: CellKey) -> Range:
        row = self._row(key)
        return int(self.hull_lo[row]), int(self.hull_hi[row])

    def cell_groups(self, key: CellKey) -> npt.NDArray[np.int32]:
        row = self._row(key)
        return self._group_flat[self._group_ptr[row] : self._group_ptr[row + 1]]

    def _row(self, key: CellKey) -> int:
        row = self.row_of(key)
        if row is None:
            raise KeyError(key)
        return row

    @property
    def spans(self) -> int:
        return sum(len(t) for t in self.files.values())

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def waiting(self) -> npt.NDArray[np.bool_]:
        """Per group: still to be warmed for the rank, neither ready nor failed nor
        reported read (a rank that read a tensor itself before it was ready needs
        nothing of it any more)."""
        waiting: npt.NDArray[np.bool_] = (self.state == PENDING) & ~self.consumed
        return waiting

    @property
    def resolved(self) -> bool:
        return not bool(self.waiting.any())

    def __hash__(self) -> int:  # its id, not its address: the same order run after run
        return self.id

    # Equality is identity (object's own, in C): a cell's waiter list is searched for a
    # request on every wait, and a Python __eq__ would make that a call per waiter.


class _RowSet:
    """The cells a request still waits for, as one flag per row: ``in``, ``discard``,
    ``len`` and iteration, like a set of cell keys at a byte per row."""

    def __init__(self, request: Request) -> None:
        self._request = request
        self._flag = np.ones(len(request._row_cell), dtype=bool)
        self._count = len(self._flag)

    @property
    def flags(self) -> npt.NDArray[np.bool_]:
        """One flag per row: still waited for."""
        return self._flag

    def __contains__(self, key: CellKey) -> bool:
        row = self._request.row_of(key)
        return row is not None and bool(self._flag[row])

    def discard(self, key: CellKey) -> None:
        row = self._request.row_of(key)
        if row is not None and self._flag[row]:
            self._flag[row] = False
            self._count -= 1

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[CellKey]:
        for row in np.flatnonzero(self._flag).tolist():
            yield self._request.key_of(row)

    def in_file(self, file: OpenFile) -> list[CellKey]:
        rows = self._request.rows_in(file)
        return [self._request.key_of(int(row)) for row in rows[self._flag[rows]]]


class CellQueue:
    """Cells handed out in an order kept as one array and a cursor: a tuple per cell
    costs about 100 bytes (20 MB per replan of a whole 1.5 TB file; 110 MB for 64 ranks
    touching 8,192 cells each). ``key`` names an entry's cell; an entry whose flag in
    ``wanted`` (indexed by entry) is False is passed over without building its key.
    Cells pushed back to the front (``appendleft``) go first."""

    def __init__(
        self,
        entries: npt.NDArray[np.int64],
        key: Callable[[int], CellKey],
        wanted: npt.NDArray[np.bool_] | None = None,
    ) -> None:
        self._entries = entries
        self._key = key
        self._wanted = wanted
        self._at = 0
        self._back: list[CellKey] = []

    def __len__(self) -> int:
        return len(self._entries) - self._at + len(self._back)

    def popleft(self) -> CellKey:
        if self._back:
            return self._back.pop()
        if self._wanted is not None:
            last = len(self._entries) - 1
            while self._at < last and not self._wanted[self._entries[self._at]]:
                self._at += 1  # settled already: skipped here, without building its key
        if self._at >= len(self._entries):
            raise IndexError("pop from an empty queue")
        self._at += 1
        return self._key(int(self._entries[self._at - 1]))

    def appendleft(self, key: CellKey) -> None:
        self._back.append(key)
