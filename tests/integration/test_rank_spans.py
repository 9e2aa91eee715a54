"""rank_spans on real checkpoints: key maps, unmatched and missing keys, DCP chunks."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import Shard, distribute_tensor  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402

from spanwarm.client import TensorSpans, rank_spans  # noqa: E402
from spanwarm.safetensors_header import read_header  # noqa: E402
from spanwarm.sample_checkpoint import SparseTensor, write_safetensors, write_sharded_checkpoint  # noqa: E402


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
