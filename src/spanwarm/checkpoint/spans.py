"""Strided byte spans and the interval algebra over them (numpy, vectorised).

A strided span names the bytes ``[offset + i*stride, offset + i*stride + length)`` for
``i in range(count)``: one row-parallel slice of a ``[rows, cols]`` tensor is one span,
not one span per row. Node-wide planning needs, per file, the exact union of many ranks'
spans (how many bytes are needed) and that union with short gaps bridged (what to read).
Both are computed without expanding every row where that can be avoided:

1. contiguous spans (``count == 1`` or ``length >= stride``) become plain intervals;
2. strided spans over the same rows (same stride, count and first row) merge their
   column ranges, so the eight TP slices of a tensor become one span;
3. a strided span whose envelope overlaps nothing else counts ``length * count`` bytes;
   only overlapping ones are expanded row by row.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = ["Intervals", "SpanTable", "StridedSpan", "merge_intervals", "run_offsets"]

Int64Array = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class StridedSpan:
    """Bytes ``[offset + i*stride, offset + i*stride + length)`` for ``i in range(count)``."""

    offset: int
    length: int
    stride: int
    count: int

    @property
    def nbytes(self) -> int:
        """Bytes named, counting rows once even if they overlap (``length > stride``)."""
        if self.count <= 1 or self.length >= self.stride:
            return self.end - self.offset
        return self.length * self.count

    @property
    def end(self) -> int:
        """One past the last byte of the last row."""
        return (
            self.offset + (self.count - 1) * self.stride + self.length
            if self.count
            else self.offset
        )

    def intervals(self) -> list[tuple[int, int]]:
        """The rows as ``(start, stop)`` pairs."""
        return [
            (self.offset + i * self.stride, self.offset + i * self.stride + self.length)
            for i in range(self.count)
        ]


@dataclass(frozen=True)
class Intervals:
    """Sorted, disjoint, non-touching half-open byte intervals."""

    starts: Int64Array
    stops: Int64Array

    def __len__(self) -> int:
        return len(self.starts)

    @property
    def nbytes(self) -> int:
        return int((self.stops - self.starts).sum())

    def pairs(self) -> list[tuple[int, int]]:
        return list(zip(self.starts.tolist(), self.stops.tolist(), strict=True))


def _empty() -> Int64Array:
    return np.zeros(0, dtype=np.int64)


def run_offsets(counts: Int64Array) -> Int64Array:
    """``0 .. c-1`` for each ``c`` in ``counts``, concatenated: the position of every item
    within its run when runs of these lengths are laid end to end (``np.repeat`` gives
    the run of each item)."""
    counts = np.asarray(counts, dtype=np.int64)
    return np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(
        np.cumsum(counts) - counts, counts
    )


def merge_intervals(starts: Int64Array, stops: Int64Array, gap: int = 0) -> Intervals:
    """Union of intervals; overlapping and touching ones join, and so do ones ``<= gap`` apart."""
    keep = stops > starts
    starts, stops = starts[keep], stops[keep]
    if len(starts) == 0:
        return Intervals(_empty(), _empty())
    order = np.argsort(starts, kind="stable")
    starts, stops = starts[order], stops[order]
    reach = np.maximum.accumulate(stops)
    first = np.empty(len(starts), dtype=bool)
    first[0] = True
    first[1:] = starts[1:] > reach[:-1] + gap
    heads = np.flatnonzero(first)
    tails = np.append(heads[1:], len(starts)) - 1
    return Intervals(starts[heads], reach[tails])


@dataclass(frozen=True)
class SpanTable:
    """Many strided spans as columns: the form the planner and the wire protocol use."""

    offset: Int64Array
    length: Int64Array
    stride: Int64Array
    count: Int64Array

    @classmethod
    def of(cls, spans: Iterable[StridedSpan]) -> SpanTable:
        rows = [(s.offset, s.length, s.stride, s.count) for s in spans]
        if not rows:
            return cls(_empty(), _empty(), _empty(), _empty())
        cols = np.array(rows, dtype=np.int64).T
        return cls(cols[0], cols[1], cols[2], cols[3])

    @classmethod
    def concat(cls, tables: Iterable[SpanTable]) -> SpanTable:
        parts = list(tables)
        if not parts:
            return cls.of(())
        return cls(*(np.concatenate([getattr(t, f) for t in parts]) for f in _FIELDS))

    def __len__(self) -> int:
        return len(self.offset)

    def envelope_stops(self) -> Int64Array:
        return self.offset + (self.count - 1) * self.stride + self.length

    def select(self, mask: npt.NDArray[np.bool_]) -> SpanTable:
        return SpanTable(self.offset[mask], self.length[mask], self.stride[mask], self.count[mask])

    def expand(self) -> tuple[Int64Array, Int64Array]:
        """Every row as an interval."""
        counts = self.count
        total = int(counts.sum())
        if total == 0:
            return _empty(), _empty()
        row = run_offsets(counts)
        starts = np.repeat(self.offset, counts) + row * np.repeat(self.stride, counts)
        return starts, starts + np.repeat(self.length, counts)

    def normalized(self) -> tuple[Intervals, SpanTable]:
        """Split into plain intervals and truly strided spans, column ranges merged."""
        nonempty = (self.length > 0) & (self.count > 0)
        contiguous = nonempty & ((self.count == 1) | (self.length >= self.stride))
        strided = _merge_columns(self.select(nonempty & ~contiguous))
        now_contiguous = strided.length >= strided.stride
        plain = self.select(contiguous)
        merged = merge_intervals(
            np.concatenate([plain.offset, strided.offset[now_contiguous]]),
            np.concatenate(
                [plain.envelope_stops(), strided.select(now_contiguous).envelope_stops()]
            ),
        )
        return merged, strided.select(~now_contiguous)

    def union(
        self, normalized: tuple[Intervals, SpanTable] | None = None
    ) -> tuple[Intervals, SpanTable]:
        """The exact union as intervals plus strided spans that overlap nothing else
        (``normalized``: this table's ``normalized()``, when the caller has it already)."""
        plain, strided = normalized or self.normalized()
        if len(strided) == 0:
            return plain, strided
        starts = np.concatenate([plain.starts, strided.offset])
        stops = np.concatenate([plain.stops, strided.envelope_stops()])
        order = np.argsort(starts, kind="stable")
        s, e = starts[order], stops[order]
        reach = np.maximum.accumulate(e)
        overlaps_prev = np.zeros(len(s), dtype=bool)
        overlaps_prev[1:] = s[1:] < reach[:-1]
        # Items chained by overlaps form a cluster; every member of a cluster of two or
        # more must be expanded to count its bytes exactly.
        cluster = np.cumsum(~overlaps_prev)
        sizes = np.bincount(cluster)
        crowded = np.empty(len(s), dtype=bool)
        crowded[order] = sizes[cluster] > 1
        crowded_strided = crowded[len(plain) :]
        expanded_starts, expanded_stops = strided.select(crowded_strided).expand()
        merged = merge_intervals(
            np.concatenate([plain.starts, expanded_starts]),
            np.concatenate([plain.stops, expanded_stops]),
        )
        return merged, strided.select(~crowded_strided)

    def covered_bytes(self, normalized: tuple[Intervals, SpanTable] | None = None) -> int:
        """Bytes in the union of all spans, each counted once."""
        plain, isolated = self.union(normalized)
        return plain.nbytes + int((isolated.length * isolated.count).sum())

    def runs(
        self, gap: int = 0, normalized: tuple[Intervals, SpanTable] | None = None
    ) -> Intervals:
        """The union with every gap of at most ``gap`` bytes bridged: what to read."""
        plain, strided = normalized or self.normalized()
        bridged = strided.stride - strided.length <= gap
        rows_starts, rows_stops = strided.select(~bridged).expand()
        return merge_intervals(
            np.concatenate([plain.starts, strided.offset[bridged], rows_starts]),
            np.concatenate([plain.stops, strided.select(bridged).envelope_stops(), rows_stops]),
            gap,
        )


_FIELDS = ("offset", "length", "stride", "count")


def _merge_columns(table: SpanTable) -> SpanTable:
    """Merge strided spans that cover the same rows into one span per column run."""
    if len(table) < 2:
        return table
    stride, count = table.stride, table.count
    row, column = np.divmod(table.offset, stride)
    order = np.lexsort((column, row, count, stride))
    stride, count, row, column = stride[order], count[order], row[order], column[order]
    length = table.length[order]
    new_group = np.ones(len(order), dtype=bool)
    new_group[1:] = (stride[1:] != stride[:-1]) | (count[1:] != count[:-1]) | (row[1:] != row[:-1])
    group = np.cumsum(new_group) - 1
    width = 2 * int(stride.max()) + 1  # column + length < 2 * stride: groups cannot touch
    if (int(group[-1]) + 1) * width >= 2**62:
        return table  # too wide to separate groups in int64; the exact expansion still applies
    merged = merge_intervals(group * width + column, group * width + column + length)
    item = np.searchsorted(group * width, merged.starts, side="right") - 1
    return SpanTable(
        row[item] * stride[item] + (merged.starts - group[item] * width),
        merged.stops - merged.starts,
        stride[item],
        count[item],
    )
