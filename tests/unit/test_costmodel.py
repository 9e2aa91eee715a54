from __future__ import annotations

import pytest

from spanwarm.checkpoint.spans import SpanTable, StridedSpan
from spanwarm.planning.costmodel import DEFAULT_SEEK_COST, plan_file

MiB = 2**20


def test_default_seek_cost_is_the_seeds_12_mib() -> None:
    assert 12 * MiB == DEFAULT_SEEK_COST


def test_spans_win_when_cheaper_than_the_whole_file() -> None:
    spans = SpanTable.of([StridedSpan(0, 128 * MiB, 1, 1), StridedSpan(256 * MiB, 128 * MiB, 1, 1)])
    plan = plan_file("f", 512 * MiB, spans, 12 * MiB)
    assert (plan.decision, plan.num_runs, plan.cost_bytes) == ("spans", 2, 280 * MiB)
    assert plan.warm_bytes == plan.needed_bytes == 256 * MiB
    assert plan.runs.pairs() == [(0, 128 * MiB), (256 * MiB, 384 * MiB)]


def test_whole_file_when_bridged_spans_cover_it() -> None:
    # The 5 MiB hole is cheaper to read than to seek over: one run, the whole file.
    spans = SpanTable.of([StridedSpan(0, 300 * MiB, 1, 1), StridedSpan(305 * MiB, 207 * MiB, 1, 1)])
    plan = plan_file("f", 512 * MiB, spans, 12 * MiB)
    assert (plan.decision, plan.warm_bytes, plan.needed_bytes) == ("whole", 512 * MiB, 507 * MiB)
    assert (plan.num_runs, plan.cost_bytes) == (1, 524 * MiB)
    assert plan.runs.pairs() == [(0, 512 * MiB)]


def test_a_hole_wider_than_a_seek_keeps_spans() -> None:
    spans = SpanTable.of([StridedSpan(0, 300 * MiB, 1, 1), StridedSpan(313 * MiB, 199 * MiB, 1, 1)])
    plan = plan_file("f", 512 * MiB, spans, 12 * MiB)
    assert (plan.decision, plan.warm_bytes, plan.cost_bytes) == ("spans", 499 * MiB, 523 * MiB)


def test_equal_cost_means_whole() -> None:
    plan = plan_file("f", 100, SpanTable.of([StridedSpan(0, 100, 100, 1)]), 10)
    assert plan.decision == "whole"


def test_gaps_up_to_the_seek_cost_are_read() -> None:
    spans = SpanTable.of([StridedSpan(0, 10, 10, 1), StridedSpan(20, 10, 10, 1)])
    plan = plan_file("f", 10_000, spans, 10)
    assert (plan.num_runs, plan.warm_bytes, plan.needed_bytes) == (1, 30, 20)


def test_header_counts_once_any_span_is_needed() -> None:
    plan = plan_file("f", 10_000, SpanTable.of([StridedSpan(5000, 10, 10, 1)]), 0, header_bytes=64)
    assert plan.runs.pairs() == [(0, 64), (5000, 5010)]
    nothing = plan_file("f", 10_000, SpanTable.of([]), 0, header_bytes=64)
    assert (nothing.warm_bytes, nothing.decision) == (0, "spans")


def test_negative_seek_cost_is_rejected() -> None:
    with pytest.raises(ValueError, match="seek cost"):
        plan_file("f", 1, SpanTable.of([]), -1)
