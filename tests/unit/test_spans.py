from __future__ import annotations

import random

import numpy as np
import pytest

from spanwarm.checkpoint.spans import SpanTable, StridedSpan, merge_intervals


def merged(pairs: list[tuple[int, int]], gap: int = 0) -> list[tuple[int, int]]:
    starts = np.array([a for a, _ in pairs], dtype=np.int64)
    stops = np.array([b for _, b in pairs], dtype=np.int64)
    return merge_intervals(starts, stops, gap).pairs()


def test_merge_overlapping_and_touching() -> None:
    assert merged([(30, 40), (0, 10), (5, 20)]) == [(0, 20), (30, 40)]
    assert merged([(0, 10), (10, 20)]) == [(0, 20)]
    assert merged([(5, 5), (7, 9)]) == [(7, 9)]  # empty intervals vanish
    assert merged([]) == []


def test_gap_bridging_at_the_seek_cost() -> None:
    assert merged([(0, 10), (60, 70)], gap=100) == [(0, 70)]
    assert merged([(0, 10), (600, 610)], gap=100) == [(0, 10), (600, 610)]
    assert merged([(0, 10), (110, 120)], gap=100) == [(0, 120)]  # a gap of exactly S bridges
    assert merged([(0, 10), (111, 120)], gap=100) == [(0, 10), (111, 120)]


def covered(spans: list[StridedSpan]) -> set[int]:
    return {b for s in spans for a, e in s.intervals() for b in range(a, e)}


def runs_of(byte_set: set[int], gap: int) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for b in sorted(byte_set):
        if out and b <= out[-1][1] + gap:
            out[-1][1] = b + 1
        else:
            out.append([b, b + 1])
    return [(a, b) for a, b in out]


def random_spans(rng: random.Random) -> list[StridedSpan]:
    spans = [
        StridedSpan(rng.randint(0, 40), rng.randint(0, 14), rng.randint(1, 12), rng.randint(0, 5))
        for _ in range(rng.randint(0, 6))
    ]
    if rng.random() < 0.5:  # column slices of one tensor, as TP ranks produce
        cols, base, rows_ = rng.randint(2, 9), rng.randint(0, 20), rng.randint(1, 5)
        spans.extend(
            StridedSpan(base + a, min(rng.randint(1, cols), cols - a), cols, rows_)
            for a in range(0, cols, rng.randint(1, cols))
        )
    return spans


def test_union_and_runs_agree_with_brute_force() -> None:
    rng = random.Random(7)
    for _ in range(2000):
        spans = random_spans(rng)
        table = SpanTable.of(spans)
        expected = covered(spans)
        assert table.covered_bytes() == len(expected), spans
        gap = rng.randint(0, 4)
        assert table.runs(gap).pairs() == runs_of(expected, gap), (spans, gap)


def test_tp_column_slices_merge_into_one_run() -> None:
    rows, cols = 4096, 8192
    spans = [StridedSpan(1000 + r * cols // 8, cols // 8, cols, rows) for r in range(8)]
    table = SpanTable.of(spans)
    assert table.runs(0).pairs() == [(1000, 1000 + rows * cols)]
    assert table.covered_bytes() == rows * cols


def test_strided_gaps_bridge_only_up_to_the_gap() -> None:
    table = SpanTable.of([StridedSpan(0, 10, 100, 3)])
    assert table.runs(gap=90).pairs() == [(0, 210)]
    assert table.runs(gap=89).pairs() == [(0, 10), (100, 110), (200, 210)]
    assert table.covered_bytes() == 30


def test_strided_span_properties() -> None:
    span = StridedSpan(10, 4, 16, 3)
    assert span.intervals() == [(10, 14), (26, 30), (42, 46)]
    assert (span.end, span.nbytes) == (46, 12)
    assert StridedSpan(0, 20, 16, 2).nbytes == 36  # overlapping rows count once


@pytest.mark.parametrize("n", [1_000_000])
def test_a_million_spans(n: int) -> None:
    rng = np.random.default_rng(0)
    offsets = np.sort(rng.integers(0, 10**12, n)).astype(np.int64)
    table = SpanTable(offsets, rng.integers(1, 4096, n), np.full(n, 8192), rng.integers(1, 3, n))
    runs = table.runs(gap=0)
    assert runs.nbytes == table.covered_bytes()
    assert np.all(runs.starts[1:] > runs.stops[:-1])
