from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from spanwarm.checkpoint.placements import IndexRuns
from spanwarm.checkpoint.spans import StridedSpan
from spanwarm.checkpoint.tensor_layout import clip_runs, tensor_spans

BITS = {"F4": 4, "F6_E2M3": 6, "U8": 8, "BF16": 16, "F32": 32}


def byte_set(spans: list[StridedSpan]) -> set[int]:
    return {b for s in spans for a, e in s.intervals() for b in range(a, e)}


def expected_bytes(
    base: int, shape: tuple[int, ...], bits: int, needed: list[IndexRuns]
) -> set[int]:
    out: set[int] = set()
    for index in itertools.product(*[[i for a, b in r for i in range(a, b)] for r in needed]):
        flat = int(np.ravel_multi_index(index, shape)) if shape else 0
        first, last = base * 8 + flat * bits, base * 8 + (flat + 1) * bits
        out.update(range(first // 8, -(-last // 8)))
    return out


def runs_of(indices: list[int]) -> IndexRuns:
    out: list[tuple[int, int]] = []
    for i in indices:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return tuple(out)


def test_random_boxes_match_element_bytes() -> None:
    rng = random.Random(3)
    for _ in range(2000):
        shape = tuple(rng.randint(0, 5) for _ in range(rng.randint(0, 4)))
        needed = [runs_of(sorted(rng.sample(range(s), rng.randint(0, s)))) for s in shape]
        dtype = rng.choice(list(BITS))
        base = 8 * rng.randint(0, 3)
        spans = tensor_spans(base, shape, dtype, needed)
        assert byte_set(spans) == expected_bytes(base, shape, BITS[dtype], needed), (
            shape,
            needed,
            dtype,
        )


def test_shard_1_slice_is_one_strided_span() -> None:
    assert tensor_spans(100, (4096, 1024), "BF16", [((0, 4096),), ((256, 512),)]) == [
        StridedSpan(100 + 512, 512, 2048, 4096)
    ]


def test_whole_and_row_slices_are_single_spans() -> None:
    assert tensor_spans(8, (6, 4), "F32", None) == [StridedSpan(8, 96, 96, 1)]
    assert tensor_spans(8, (6, 4), "F32", [((2, 4),), ((0, 4),)]) == [StridedSpan(40, 32, 32, 1)]
    assert tensor_spans(8, (), "F64", None) == [StridedSpan(8, 8, 8, 1)]
    assert tensor_spans(8, (0, 4), "F32", None) == []


def test_strided_rows_of_a_3d_tensor() -> None:
    # [E, 2I, H] gate_up with _StridedShard(1, sf=2) on 2 ranks: rank 0 holds rows 0-1 and 4-5.
    spans = tensor_spans(0, (3, 8, 2), "BF16", [((0, 3),), ((0, 2), (4, 6)), ((0, 2),)])
    assert spans == [StridedSpan(0, 8, 32, 3), StridedSpan(16, 8, 32, 3)]


def test_sub_byte_rows_round_outward() -> None:
    # F4 [3, 3]: rows are 12 bits, not byte-aligned; column 1 of each row.
    spans = tensor_spans(0, (3, 3), "F4", [((0, 3),), ((1, 2),)])
    assert spans == [StridedSpan(0, 1, 1, 1), StridedSpan(2, 1, 1, 1), StridedSpan(3, 1, 1, 1)]


def test_chunk_intersection() -> None:
    # The file stores rows 4..8 of a global [8, 2] tensor; the rank needs rows 2..6.
    spans = tensor_spans(0, (4, 2), "U8", [((2, 6),), ((0, 2),)], global_offset=(4, 0))
    assert spans == [StridedSpan(0, 4, 4, 1)]
    assert tensor_spans(0, (4, 2), "U8", [((0, 4),), ((0, 2),)], global_offset=(4, 0)) == []


def test_clip_runs() -> None:
    assert clip_runs(((0, 3), (5, 9), (12, 14)), 2, 8) == ((0, 1), (3, 7))


def test_wrong_rank_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="2 dims of index runs"):
        tensor_spans(0, (4,), "U8", [((0, 4),), ((0, 1),)])
