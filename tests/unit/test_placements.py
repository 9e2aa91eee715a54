from __future__ import annotations

import pytest

from spanwarm.checkpoint.placements import (
    IndexRuns,
    Partial,
    Replicate,
    Shard,
    StridedShard,
    local_index_runs,
    parse_placements,
)

COORDS = [(0, 0), (0, 1), (1, 0), (1, 1)]


def rows(runs: IndexRuns) -> list[int]:
    return [i for a, b in runs for i in range(a, b)]


@pytest.mark.parametrize(
    ("placements", "expected"),
    [
        ("[Shard(0),Shard(0)]", [[0, 1], [2, 3], [4, 5], [6, 7]]),
        ("[_StridedShard(0,sf=2),Shard(0)]", [[0, 1], [4, 5], [2, 3], [6, 7]]),
        ("[Shard(0),_StridedShard(0,sf=2)]", [[0, 2], [1, 3], [4, 6], [5, 7]]),
        ("[Replicate(),Shard(1)]", [list(range(8))] * 4),
    ],
)
def test_research_table_for_8x4_on_2x2(placements: str, expected: list[list[int]]) -> None:
    for coord, want in zip(COORDS, expected, strict=True):
        assert (
            rows(local_index_runs((8, 4), (2, 2), coord, parse_placements(placements))[0]) == want
        )


def test_strided_shard_is_not_contiguous() -> None:
    got = [
        rows(
            local_index_runs(
                (16, 8), (2, 2), c, parse_placements("[_StridedShard(0,sf=4),Shard(0)]")
            )[0]
        )
        for c in COORDS
    ]
    assert got == [[0, 1, 4, 5], [8, 9, 12, 13], [2, 3, 6, 7], [10, 11, 14, 15]]


def test_uneven_and_empty_shards_follow_torch_chunk() -> None:
    assert [rows(local_index_runs((5,), (4,), (r,), [Shard(0)])[0]) for r in range(4)] == [
        [0, 1],
        [2, 3],
        [4],
        [],
    ]
    assert [rows(local_index_runs((6,), (4,), (r,), [Shard(0)])[0]) for r in range(4)] == [
        [0, 1],
        [2, 3],
        [4, 5],
        [],
    ]
    assert [
        rows(local_index_runs((9,), (4,), (r,), [StridedShard(0, 2)])[0]) for r in range(4)
    ] == [
        [0, 1, 5],
        [2, 3, 6],
        [4, 7],
        [8],
    ]


def test_replicate_partial_and_negative_dims() -> None:
    assert local_index_runs((4, 6), (2,), (1,), [Partial()]) == (((0, 4),), ((0, 6),))
    assert local_index_runs((4, 6), (2,), (1,), [Shard(-1)]) == (((0, 4),), ((3, 6),))


def test_strided_shard_on_a_mesh_dim_of_size_1() -> None:
    assert local_index_runs((8,), (1, 4), (0, 1), [StridedShard(0, 2), Shard(0)]) == (((2, 4),),)


def test_bad_arguments_are_value_errors() -> None:
    with pytest.raises(ValueError, match="one entry per mesh dim"):
        local_index_runs((4,), (2, 2), (0, 0), [Shard(0)])
    with pytest.raises(ValueError, match="outside mesh dim 0"):
        local_index_runs((4,), (2,), (2,), [Shard(0)])
    with pytest.raises(ValueError, match="does not fit a 1-d tensor"):
        local_index_runs((4,), (2,), (0,), [Shard(1)])
    with pytest.raises(ValueError, match="split_factor"):
        StridedShard(0, 0)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Shard(0)", (Shard(0),)),
        ("[Shard(dim=1), Replicate()]", (Shard(1), Replicate())),
        ("[_StridedShard(0,sf=2),Shard(0)]", (StridedShard(0, 2), Shard(0))),
        ("_StridedShard(dim=1, split_factor=4)", (StridedShard(1, 4),)),
        ("[Partial(sum),Shard(-1)]", (Partial(), Shard(-1))),
    ],
)
def test_parse_placements(text: str, expected: tuple[object, ...]) -> None:
    assert parse_placements(text) == expected


@pytest.mark.parametrize("text", ["", "Shard(x)", "[Shard(0)Shard(1)]", "Bogus()", "[Shard(0),]"])
def test_parse_placements_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="cannot parse placements"):
        parse_placements(text)


def test_str_round_trips() -> None:
    placements = (StridedShard(0, 4), Shard(1), Replicate(), Partial())
    text = "[" + ",".join(map(str, placements)) + "]"
    assert parse_placements(text) == (StridedShard(0, 4), Shard(1), Replicate(), Partial())
