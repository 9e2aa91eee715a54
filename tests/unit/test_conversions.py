"""Weight conversions without torch: routes, read order, and the bytes a piece needs."""

from __future__ import annotations

import pytest

from spanwarm.checkpoint.conversions import (
    Chunk,
    Concat,
    Conversion,
    Converted,
    OtherOp,
    Stack,
    natural_key,
    read_runs,
)
from spanwarm.checkpoint.placements import Replicate, Shard, StridedShard

# A packed [E=8, 2I=12, H=4] gate_up parameter; its per-expert sources are [6, 4].
TARGET = (8, 12, 4)
PIECE = (6, 4)
WHOLE_PIECE = (((0, 6),), ((0, 4),))  # index runs per dim


def test_natural_key_orders_numbers_numerically() -> None:
    names = ["e.10.w", "e.2.w", "e.1.w", "shard_11", "shard_2", "a"]
    assert sorted(names, key=natural_key) == [
        "a",
        "e.1.w",
        "e.2.w",
        "e.10.w",
        "shard_2",
        "shard_11",
    ]


def test_a_conversion_routes_to_its_target_and_remembers_the_pattern() -> None:
    rule = Conversion(("experts.*.w1.weight", "experts.*.w3.weight"), "experts.gate_up", (Stack(),))
    assert rule.match("layers.0.experts.5.w3.weight") == Converted(
        "layers.0.experts.gate_up", "experts.*.w3.weight", (Stack(0),)
    )
    assert rule.match("layers.0.experts.5.w2.weight") is None
    assert Converted("t", "s", (Stack(0), Concat(1), Chunk(0))).exact
    assert not Converted("t", "s", (Stack(0), OtherOp("Transpose"))).exact


@pytest.mark.parametrize(
    ("coordinate", "owned"),
    [((0,), {0, 1}), ((1,), {2, 3}), ((3,), {6, 7})],
)
def test_expert_pieces_are_read_only_by_their_owner(
    coordinate: tuple[int], owned: set[int]
) -> None:
    for expert in range(8):
        runs = read_runs(PIECE, TARGET, (4,), coordinate, (Shard(0),), expert)
        if expert in owned:
            assert runs == WHOLE_PIECE
        else:
            assert runs is False


def test_indices_past_the_expert_count_wrap_around() -> None:
    # A list that fills two parameters back to back: index 9 is expert 1 again.
    assert read_runs(PIECE, TARGET, (4,), (0,), (Shard(0),), 9) == WHOLE_PIECE
    assert read_runs(PIECE, TARGET, (4,), (1,), (Shard(0),), 9) is False


def test_inner_placements_slice_the_piece_contiguously_even_when_strided() -> None:
    # TP over the packed dim 1 as _StridedShard(1, sf=2): each w1/w3 piece is chunked.
    runs = read_runs(PIECE, TARGET, (2,), (1,), (StridedShard(1, 2),), 0)
    assert runs == (((3, 6),), ((0, 4),))
    # FSDP on the experts and TP on dim 2: owner check, then a column slice.
    assert read_runs(PIECE, TARGET, (2, 2), (0, 1), (Shard(0), Shard(2)), 3) == (
        ((0, 6),),
        ((2, 4),),
    )
    assert read_runs(PIECE, TARGET, (2, 2), (1, 1), (Shard(0), Shard(2)), 3) is False


def test_a_source_of_the_targets_rank_gets_the_targets_placements() -> None:
    # A fused [3D, H] source chunked into q/k/v of [D, H]: transformers slices the fused
    # tensor with q's placements.
    assert read_runs((12, 4), (4, 4), (2,), (1,), (Shard(0),), 0) == (((6, 12),), ((0, 4),))
    assert read_runs((12, 4), (4, 4), (2,), (1,), (Replicate(),), 0) == (((0, 12),), ((0, 4),))


def test_placements_that_do_not_fit_the_source_read_it_whole() -> None:
    # Shard(2) of a 3-d target cannot apply to a 2-d source that is not a stacked piece.
    assert read_runs((6, 4), (8, 12, 4), (2,), (0,), (Shard(2),), None) is None


def test_negative_dims_count_from_the_targets_last_dim() -> None:
    # Shard(-1) of a 3-d target is its dim 2; on a 3-d fused source that is dim 2 too,
    # and on a 4-d source (dense path, more dims) it stays dim 2, as transformers counts.
    assert read_runs((2, 3, 8), (2, 3, 4), (2,), (1,), (Shard(-1),), None) == (
        ((0, 2),),
        ((0, 3),),
        ((4, 8),),
    )
    assert read_runs((2, 3, 8, 5), (2, 3, 4), (2,), (1,), (Shard(-1),), None) == (
        ((0, 2),),
        ((0, 3),),
        ((4, 8),),
        ((0, 5),),
    )
