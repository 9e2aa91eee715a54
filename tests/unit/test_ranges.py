"""The byte-range algebra of cells, against a page-by-page set model."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from spanwarm.checkpoint.spans import Intervals
from spanwarm.daemon.ranges import clip, overlap_bytes, since, subtract, total, union

_ranges = st.lists(
    st.tuples(st.integers(0, 200), st.integers(0, 40)).map(lambda t: (t[0], t[0] + t[1])),
    max_size=12,
)


def _bytes(ranges: list[tuple[int, int]]) -> set[int]:
    return {i for a, b in ranges for i in range(a, b)}


@given(_ranges)
def test_union_is_sorted_disjoint_and_covers_the_same_bytes(ranges: list[tuple[int, int]]) -> None:
    out = union(r for r in ranges if r[1] > r[0])
    assert _bytes(out) == _bytes(ranges)
    assert all(a < b for a, b in out)
    assert all(out[i][1] < out[i + 1][0] for i in range(len(out) - 1))


@given(_ranges, _ranges)
def test_subtract_leaves_exactly_the_bytes_not_in_the_holes(
    ranges: list[tuple[int, int]], holes: list[tuple[int, int]]
) -> None:
    xs, hs = union(ranges), union(holes)
    out = subtract(xs, hs)
    assert _bytes(out) == _bytes(xs) - _bytes(hs)
    assert total(out) == len(_bytes(out))


@given(_ranges, st.integers(0, 250), st.integers(0, 250))
def test_clip_keeps_what_is_inside(ranges: list[tuple[int, int]], lo: int, hi: int) -> None:
    xs = union(ranges)
    assert _bytes(clip(xs, lo, hi)) == {i for i in _bytes(xs) if lo <= i < hi}


def test_since_keeps_records_made_at_or_after_the_time() -> None:
    records = [(0, 10, 1.0), (5, 20, 2.0), (30, 40, 3.0)]
    assert since(records, 2.0) == [(5, 20), (30, 40)]
    assert since(records, 0.0) == [(0, 20), (30, 40)]
    assert since(records, 9.0) == []


@given(_ranges, _ranges)
def test_overlap_bytes_counts_the_intersection(
    ranges: list[tuple[int, int]], runs: list[tuple[int, int]]
) -> None:
    xs = union(ranges)
    merged = [(a, b) for a, b in union(runs)]
    intervals = Intervals(
        np.array([a for a, _ in merged], np.int64), np.array([b for _, b in merged], np.int64)
    )
    assert overlap_bytes(xs, intervals) == len(_bytes(xs) & _bytes(merged))
