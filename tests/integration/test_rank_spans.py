"""rank_spans on real checkpoints: key maps, unmatched and missing keys, DCP chunks."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh  # noqa: E402
from torch.distributed.tensor import Shard, distribute_tensor  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402

from spanwarm.checkpoint.conversions import Concat, Conversion, Converted, OtherOp, Stack  # noqa: E402
from spanwarm.checkpoint.safetensors_header import read_header  # noqa: E402
from spanwarm.checkpoint.samples import SparseTensor, write_safetensors, write_sharded_checkpoint  # noqa: E402
from spanwarm.client import TensorSpans, rank_spans  # noqa: E402


@pytest.fixture
def rank1_of_4():  # type: ignore[no-untyped-def]
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    yield init_device_mesh("cpu", (4,))
    dist.destroy_process_group()


def whole(path: Path, name: str) -> tuple[int, int]:
    header = read_header(path)
    t = next(t for t in header.tensors if t.name == name)
    return header.file_offset(t), t.nbytes


def test_plain_tensors_need_the_whole_tensor(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_file({"a": torch.zeros(4, 4), "b": torch.zeros(3)}, str(path))
    spans = rank_spans({"b": torch.empty(3, device="meta")}, path, unmatched="skip")
    offset, nbytes = whole(path, "b")
    assert spans == [TensorSpans("b", str(path), offset, nbytes, nbytes, 1)]


def test_unmatched_tensors_are_warmed_whole_unless_skipped(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_file({"a": torch.zeros(4, 4), "b": torch.zeros(3)}, str(path))
    spans = rank_spans({"b": torch.empty(3)}, path)
    assert [s.tensor for s in spans] == ["b", "a"]  # state-dict order, then unmatched in file order
    assert (spans[1].offset, spans[1].length) == whole(path, "a")
    assert [s.tensor for s in rank_spans({"b": torch.empty(3)}, path, unmatched="skip")] == ["b"]


def test_missing_keys_give_one_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "m.safetensors"
    save_file({"a": torch.zeros(2)}, str(path))
    with caplog.at_level(logging.WARNING, logger="spanwarm.client"):
        spans = rank_spans({"a": torch.empty(2), "x": torch.empty(1), "y": torch.empty(1)}, path)
    assert [s.tensor for s in spans] == ["a"]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "2 state-dict keys are not in the checkpoint: x, y" in warnings[0].getMessage()


def test_key_map_renames_and_drops(tmp_path: Path, rank1_of_4) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "m.safetensors"
    save_file({"model.w": torch.zeros(8, 2), "model.skip": torch.zeros(2)}, str(path))
    meta = distribute_tensor(
        torch.empty(8, 2, device="meta"), rank1_of_4, [Shard(0)], src_data_rank=None
    )
    offset, _ = whole(path, "model.w")
    key_map = {"model.w": "w", "model.skip": None}
    spans = rank_spans({"w": meta}, path, key_map=key_map, unmatched="skip")
    assert spans == [TensorSpans("model.w", str(path), offset + 2 * 2 * 4, 16, 16, 1)]
    same = rank_spans(
        {"w": meta}, path, key_map=lambda k: {"model.w": "w"}.get(k), unmatched="skip"
    )
    assert same == spans
    # Mapped to None is unmatched: read whole by default, like any unmatched tensor.
    skip_offset, skip_bytes = whole(path, "model.skip")
    assert rank_spans({"w": meta}, path, key_map=key_map)[1:] == [
        TensorSpans("model.skip", str(path), skip_offset, skip_bytes, skip_bytes, 1)
    ]


def test_first_pages_name_what_each_slice_faults_in_an_empty_one_too(
    tmp_path: Path,
    rank1_of_4: DeviceMesh,
) -> None:
    """With first_pages, each tensor a rank slices gets the page of its first byte before
    its spans: also where its box is empty (a [2, 4096] tensor over 4 ranks: ranks 2
    and 3 slice it for nothing, and the slice still faults that page in), never for a
    tensor read from its first byte."""
    path = tmp_path / "m.safetensors"
    save_file(
        {"pad": torch.zeros(1000), "small": torch.zeros(2, 4096), "w": torch.zeros(8, 4096)},
        str(path),
    )
    meta = {
        name: distribute_tensor(
            torch.empty(shape, device="meta"), rank1_of_4, [Shard(0)], src_data_rank=None
        )
        for name, shape in (("small", (2, 4096)), ("w", (8, 4096)))
    }
    row = 4096 * 4
    pages = {}
    for name in ("small", "w"):
        begin, nbytes = whole(path, name)
        first = min(4096 - begin % 4096, nbytes)
        pages[name] = TensorSpans(name, str(path), begin, first, first, 1)
    small, _ = whole(path, "small")
    w, _ = whole(path, "w")
    for rank, rows in (
        (0, {"small": [0], "w": [0, 1]}),
        (1, {"small": [1], "w": [2, 3]}),
        (2, {"small": [], "w": [4, 5]}),
    ):
        copied = rank_spans(meta, path, unmatched="skip", rank=rank)
        asked = rank_spans(meta, path, unmatched="skip", rank=rank, first_pages=True)
        expected = []
        for name, begin in (("small", small), ("w", w)):
            spans = [s for s in copied if s.tensor == name]
            assert [(s.offset - begin) // row for s in spans] == rows[name][:1], (rank, name)
            if not rows[name] or rows[name][0] > 0:  # not from the first byte: its page
                expected.append(pages[name])
            expected.extend(spans)
        assert asked == expected, rank
    # A plain tensor is read whole, from its first byte: nothing to add.
    plain = {"small": torch.empty(2, 4096, device="meta")}
    assert rank_spans(plain, path, unmatched="skip", first_pages=True) == rank_spans(
        plain, path, unmatched="skip"
    )


def test_shape_mismatch_falls_back_to_the_whole_tensor(tmp_path: Path, rank1_of_4) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "m.safetensors"
    save_file({"w": torch.zeros(8, 2)}, str(path))
    meta = distribute_tensor(
        torch.empty(4, 4, device="meta"), rank1_of_4, [Shard(0)], src_data_rank=None
    )
    offset, nbytes = whole(path, "w")
    assert [(s.offset, s.length) for s in rank_spans({"w": meta}, path)] == [(offset, nbytes)]


def test_directory_index_and_file_list(tmp_path: Path, rank1_of_4) -> None:  # type: ignore[no-untyped-def]
    tensors = {f"layer{i}": SparseTensor("BF16", (64, 32)) for i in range(4)}
    paths = write_sharded_checkpoint(tmp_path / "ckpt", tensors, shard_bytes=2 * 64 * 32 * 2)
    assert len(paths) == 2
    state = {
        name: distribute_tensor(
            torch.empty(64, 32, dtype=torch.bfloat16, device="meta"),
            rank1_of_4,
            [Shard(1)],
            src_data_rank=None,
        )
        for name in tensors
    }
    from_dir = rank_spans(state, tmp_path / "ckpt")
    assert from_dir == rank_spans(state, [str(p) for p in paths])
    assert [s.tensor for s in from_dir] == list(tensors)
    # Shard(1) of [64, 32] bf16 on 4 ranks: rank 1 holds columns 8..16 of every row.
    assert {(s.length, s.stride, s.count) for s in from_dir} == {(16, 64, 64)}


def test_dcp_chunks_are_intersected_with_the_rank_slice(tmp_path: Path, rank1_of_4) -> None:  # type: ignore[no-untyped-def]
    # Two files each hold half the rows of a global [8, 4] u8 tensor.
    for i in range(2):
        info = json.dumps({"w": {"saved_offsets": [4 * i, 0]}})
        write_safetensors(
            tmp_path / f"{i}.safetensors",
            {"w": ("U8", (4, 4), bytes(range(16 * i, 16 * i + 16)))},
            metadata={"DCP_SHARDING_INFO": info},
        )
    meta = distribute_tensor(
        torch.empty(8, 4, dtype=torch.uint8, device="meta"),
        rank1_of_4,
        [Shard(0)],
        src_data_rank=None,
    )
    spans = rank_spans({"w": meta}, tmp_path)  # rank 1 holds global rows 2..4: file 0's rows 2..4
    assert len(spans) == 1
    data = (tmp_path / "0.safetensors").read_bytes()[
        spans[0].offset : spans[0].offset + spans[0].length
    ]
    assert data == bytes(range(8, 16))


def test_bad_unmatched_value(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_file({"a": torch.zeros(2)}, str(path))
    with pytest.raises(ValueError, match="unmatched"):
        rank_spans({}, path, unmatched="all")  # type: ignore[arg-type]


def _experts_checkpoint(path: Path, experts: int = 8, inter: int = 6, hidden: int = 4) -> None:
    tensors = {}
    for e in range(experts):
        for name in ("w1", "w3"):
            tensors[f"layer.experts.{e}.{name}.weight"] = torch.full((inter, hidden), float(e))
        tensors[f"layer.experts.{e}.w2.weight"] = torch.full((hidden, inter), float(e))
    save_file(tensors, str(path))


GATE_UP = Conversion(
    ("experts.*.w1.weight", "experts.*.w3.weight"), "experts.gate_up_proj", (Stack(0), Concat(1))
)
DOWN = Conversion(("experts.*.w2.weight",), "experts.down_proj", (Stack(0),))


def test_per_expert_pieces_are_read_only_by_the_rank_owning_the_expert(
    tmp_path: Path,
    rank1_of_4: DeviceMesh,
) -> None:
    path = tmp_path / "experts.safetensors"
    _experts_checkpoint(path)
    state = {
        "layer.experts.gate_up_proj": distribute_tensor(
            torch.empty(8, 12, 4, device="meta"), rank1_of_4, [Shard(0)], src_data_rank=None
        ),
        "layer.experts.down_proj": distribute_tensor(
            torch.empty(8, 4, 6, device="meta"), rank1_of_4, [Shard(0)], src_data_rank=None
        ),
    }
    spans = rank_spans(state, path, conversions=[GATE_UP, DOWN])
    # Rank 1 of 4 owns experts 2 and 3: their w1, w3 and w2, whole, and nothing else.
    assert sorted(s.tensor for s in spans) == sorted(
        f"layer.experts.{e}.{w}.weight" for e in (2, 3) for w in ("w1", "w2", "w3")
    )
    for s in spans:
        assert (s.offset, s.length * s.count) == whole(path, s.tensor)


def test_inner_placements_slice_each_expert_piece(
    tmp_path: Path,
    rank1_of_4: DeviceMesh,
) -> None:
    path = tmp_path / "experts.safetensors"
    _experts_checkpoint(path)
    gate_up = distribute_tensor(
        torch.empty(8, 12, 4, device="meta"), rank1_of_4, [Shard(2)], src_data_rank=None
    )
    spans = rank_spans(
        {"layer.experts.gate_up_proj": gate_up}, path, conversions=[GATE_UP], unmatched="skip"
    )
    # Shard(2) of the packed tensor is column 1 of every [6, 4] w1/w3 piece: 6 rows of 4 bytes.
    assert {s.tensor for s in spans} == {
        f"layer.experts.{e}.{w}.weight" for e in range(8) for w in ("w1", "w3")
    }
    for s in spans:
        offset, _ = whole(path, s.tensor)
        assert (s.offset, s.length, s.stride, s.count) == (offset + 4, 4, 16, 6)


def test_an_unmodelled_operation_reads_the_source_whole_with_a_debug_line(
    tmp_path: Path, rank1_of_4: DeviceMesh, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "experts.safetensors"
    _experts_checkpoint(path, experts=1)
    transpose = Conversion(("experts.*.w2.weight",), "experts.down_t", (OtherOp("Transpose"),))
    state = {
        "layer.experts.down_t": distribute_tensor(
            torch.empty(1, 6, 4, device="meta"), rank1_of_4, [Shard(1)], src_data_rank=None
        )
    }
    with caplog.at_level(logging.DEBUG, logger="spanwarm.client"):
        spans = rank_spans(state, path, conversions=[transpose], unmatched="skip")
    assert [(s.tensor, s.length * s.count) for s in spans] == [("layer.experts.0.w2.weight", 96)]
    assert any("Transpose" in r.getMessage() for r in caplog.records)


def test_conversion_patterns_end_on_a_name_boundary() -> None:
    assert GATE_UP.match("model.layer.experts.12.w3.weight") == Converted(
        "model.layer.experts.gate_up_proj", "experts.*.w3.weight", (Stack(0), Concat(1))
    )
    assert GATE_UP.match("model.layer.experts.12.w3.weight_scale") is None
    assert GATE_UP.match("model.layer.experts.x.w3.weight") is None
