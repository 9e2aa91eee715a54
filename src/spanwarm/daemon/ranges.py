"""Byte ranges ``[start, stop)`` as sorted, disjoint lists: what a cell's warm and failed
records, its need and its plan are made of. Pure functions on small lists (a cell holds a
few ranges); :func:`overlap_bytes` is vectorised because a plan can have millions of runs."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import numpy.typing as npt

from spanwarm.checkpoint.spans import Intervals

__all__ = ["Range", "clip", "overlap_bytes", "since", "subtract", "total", "union"]

Range = tuple[int, int]


def union(ranges: Iterable[Range]) -> list[Range]:
    """The union of any ranges, sorted and disjoint (touching ranges are merged)."""
    out: list[Range] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def subtract(ranges: list[Range], holes: list[Range]) -> list[Range]:
    """``ranges`` minus ``holes`` (both sorted, disjoint)."""
    out: list[Range] = []
    for a, b in ranges:
        for h0, h1 in holes:
            if h1 <= a or h0 >= b:
                continue
            if h0 > a:
                out.append((a, h0))
            a = max(a, h1)
            if a >= b:
                break
        if a < b:
            out.append((a, b))
    return out


def clip(ranges: Iterable[Range], lo: int, hi: int) -> list[Range]:
    """The parts of ``ranges`` inside ``[lo, hi)``."""
    return [(max(a, lo), min(b, hi)) for a, b in ranges if a < hi and b > lo]


def since(records: Iterable[tuple[int, int, float]], when: float) -> list[Range]:
    """The ranges of ``(start, stop, time)`` records made at or after ``when``, as one
    sorted, disjoint list."""
    return union((a, b) for a, b, t in records if t >= when)


def total(ranges: Iterable[Range]) -> int:
    """Bytes in ``ranges`` (disjoint)."""
    return sum(b - a for a, b in ranges)


def overlap_bytes(xs: list[Range], runs: Intervals) -> int:
    """Bytes in both ``xs`` (sorted, disjoint) and ``runs``."""
    if not xs or not len(runs):
        return 0
    starts = np.fromiter((a for a, _ in xs), np.int64, len(xs))
    stops = np.fromiter((b for _, b in xs), np.int64, len(xs))
    below = np.concatenate([[0], np.cumsum(stops - starts)])  # bytes of xs before each range

    def covered_below(x: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        i = np.searchsorted(starts, x, side="right") - 1
        inside = np.where(i >= 0, np.minimum(x, stops[i]) - starts[i], 0)
        return np.where(i >= 0, below[np.maximum(i, 0)] + inside, 0)

    return int((covered_below(runs.stops) - covered_below(runs.starts)).sum())
