"""rank_spans and the placement model against real DTensors (torch's fake process group).

For every rank of every mesh, ``distribute_tensor(arange, mesh, placements,
src_data_rank=None)`` tells which elements the rank holds; the bytes ``rank_spans``
names must be exactly the bytes of those elements in a file written by safetensors.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh  # noqa: E402
from torch.distributed.tensor import Replicate, Shard, distribute_tensor  # noqa: E402
from torch.distributed.tensor.placement_types import Placement, _StridedShard  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402

from spanwarm.checkpoint import placements as model  # noqa: E402
from spanwarm.checkpoint.safetensors_header import read_header  # noqa: E402
from spanwarm.client import rank_spans  # noqa: E402

SS = _StridedShard
DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.float8_e4m3fn,
]
SHAPES = [(16, 8), (5, 3), (2, 7), (3, 6, 10), (9,), (12, 4)]

ONE_D: list[list[Placement]] = [
    [Shard(0)],
    [Shard(1)],
    [Replicate()],
    [SS(0, split_factor=2)],
    [SS(1, split_factor=4)],
    [Shard(-1)],
]
TWO_D: list[list[Placement]] = [
    [Shard(0), Shard(0)],
    [Shard(0), Shard(1)],
    [Shard(1), Shard(0)],
    [Replicate(), Shard(1)],
    [Shard(0), Replicate()],
    [SS(0, split_factor=2), Shard(0)],
    [Shard(0), SS(0, split_factor=2)],
    [SS(0, split_factor=4), Shard(0)],
    [Shard(0), SS(0, split_factor=4)],
    [SS(1, split_factor=2), Shard(1)],
    [SS(0, split_factor=2), Shard(1)],
]
THREE_D: list[list[Placement]] = [
    [Shard(0), Shard(0), Shard(0)],
    [Shard(0), Shard(1), Replicate()],
    [SS(0, split_factor=2), Shard(0), Shard(1)],
    [Shard(0), SS(0, split_factor=2), Shard(0)],
    [Replicate(), SS(1, split_factor=4), Shard(1)],
    [SS(0, split_factor=4), Shard(0), Shard(0)],
]
MESHES = {(4,): ONE_D, (2, 2): TWO_D, (2, 4): TWO_D, (2, 2, 2): THREE_D}


@contextmanager
def fake_rank(rank: int, world: int) -> Iterator[None]:
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def fits(shape: tuple[int, ...], placements: list[Placement]) -> bool:
    return all(-len(shape) <= p.dim < len(shape) for p in placements if isinstance(p, Shard | SS))


def cases(
    mesh_shape: tuple[int, ...],
) -> list[tuple[str, tuple[int, ...], Any, list[Placement]]]:
    out = []
    combos = [(s, p) for s, p in itertools.product(SHAPES, MESHES[mesh_shape]) if fits(s, p)]
    for i, (shape, placements) in enumerate(combos):
        out.append((f"t{i}", shape, DTYPES[i % len(DTYPES)], placements))
    return out


def to_model(placements: list[Placement]) -> list[model.Placement]:
    out: list[model.Placement] = []
    for p in placements:
        if isinstance(p, SS):
            out.append(model.StridedShard(p.dim, int(p.split_factor)))
        elif isinstance(p, Shard):
            out.append(model.Shard(p.dim))
        else:
            out.append(model.Replicate())
    return out


def held_elements(
    shape: tuple[int, ...], mesh: DeviceMesh, placements: list[Placement]
) -> np.ndarray:
    numel = int(np.prod(shape))
    full = torch.arange(numel, dtype=torch.int64).reshape(shape)
    local = distribute_tensor(full, mesh, placements, src_data_rank=None).to_local()
    return local.reshape(-1).numpy()


def named_bytes(spans: list) -> set[int]:  # type: ignore[type-arg]
    return {b for s in spans for a, e in s.span.intervals() for b in range(a, e)}


@pytest.mark.parametrize("mesh_shape", list(MESHES), ids=lambda m: "x".join(map(str, m)))
def test_rank_spans_name_exactly_the_held_bytes(
    tmp_path: Path, mesh_shape: tuple[int, ...]
) -> None:
    todo = cases(mesh_shape)
    path = tmp_path / "ckpt.safetensors"
    save_file({name: torch.zeros(shape, dtype=dtype) for name, shape, dtype, _ in todo}, str(path))
    header = read_header(path)
    where = {t.name: header.file_offset(t) for t in header.tensors}
    world = int(np.prod(mesh_shape))
    checked = 0
    for rank in range(world):
        with fake_rank(rank, world):
            mesh = init_device_mesh("cpu", mesh_shape)
            coordinate = mesh.get_coordinate()
            assert coordinate is not None
            for name, shape, dtype, placements in todo:
                held = held_elements(shape, mesh, placements)
                label = f"{name} {shape} {dtype} {placements} rank {rank}"

                # The torch-free model gives the same per-dim indices as torch.
                runs = model.local_index_runs(shape, mesh_shape, coordinate, to_model(placements))
                if held.size:
                    per_dim = np.unravel_index(held, shape)
                    for d, indices in enumerate(per_dim):
                        assert sorted(set(indices.tolist())) == [
                            i for a, b in runs[d] for i in range(a, b)
                        ], label
                else:
                    assert any(not r for r in runs), label

                # rank_spans names exactly the bytes of the held elements.
                meta = distribute_tensor(
                    torch.empty(shape, dtype=dtype, device="meta"),
                    mesh,
                    placements,
                    src_data_rank=None,
                )
                spans = rank_spans({name: meta}, path, unmatched="skip")
                assert all(s.tensor == name and s.path == str(path) for s in spans)
                size = torch.empty((), dtype=dtype).element_size()
                expected = {where[name] + int(e) * size + k for e in held for k in range(size)}
                assert named_bytes(spans) == expected, label
                checked += 1
    assert checked >= world * 20


def test_bytes_read_through_spans_equal_the_local_tensor(tmp_path: Path) -> None:
    """Read the file at the named spans: the bytes are the rank's local tensor, in order."""
    path = tmp_path / "data.safetensors"
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(24, 40, generator=gen).to(torch.bfloat16)
    save_file({"w": weight}, str(path))
    raw = np.frombuffer(path.read_bytes(), dtype=np.uint8)
    for placements in (
        [Shard(1), Shard(0)],
        [SS(0, split_factor=4), Shard(0)],
        [Shard(0), SS(1, split_factor=2)],
    ):
        for rank in range(4):
            with fake_rank(rank, 4):
                mesh = init_device_mesh("cpu", (2, 2))
                local = distribute_tensor(weight, mesh, placements, src_data_rank=None).to_local()
                positions = sorted(
                    named_bytes(
                        rank_spans(
                            {"w": distribute_tensor(weight, mesh, placements, src_data_rank=None)},
                            path,
                        )
                    )
                )
                got = raw[positions].tobytes()
                assert got == local.contiguous().view(torch.uint8).numpy().tobytes(), (
                    placements,
                    rank,
                )


def test_rank_outside_the_mesh_needs_nothing(tmp_path: Path) -> None:
    path = tmp_path / "e.safetensors"
    save_file({"experts": torch.zeros(8, 4)}, str(path))
    with fake_rank(3, 4):
        sub_mesh = DeviceMesh("cpu", [0, 1])  # ranks 0 and 1 only; rank 3 is outside
        assert sub_mesh.get_coordinate() is None
        meta = distribute_tensor(
            torch.empty(8, 4, device="meta"), sub_mesh, [Shard(0)], src_data_rank=None
        )
        assert rank_spans({"experts": meta}, path) == []


def test_f4_packed_pairs_map_to_their_bytes(tmp_path: Path) -> None:
    """torch's float4_e2m1fn_x2 holds two F4 values per element; the header counts values."""
    path = tmp_path / "f4.safetensors"
    storage = torch.zeros(4, 3, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    save_file({"w": storage}, str(path))
    header = read_header(path)
    assert header.tensors[0].shape == (4, 6)
    base = header.file_offset(header.tensors[0])
    layouts: list[list[Placement]] = [[Shard(1)], [Shard(0)], [SS(1, split_factor=2)]]
    for placements in layouts:
        for rank in range(2):
            with fake_rank(rank, 2):
                mesh = init_device_mesh("cpu", (2,))
                held = held_elements((4, 3), mesh, placements)  # one byte per torch element
                meta = distribute_tensor(
                    torch.empty(4, 3, dtype=torch.float4_e2m1fn_x2, device="meta"),
                    mesh,
                    placements,
                    src_data_rank=None,
                )
                spans = rank_spans({"w": meta}, path)
                assert named_bytes(spans) == {base + int(e) for e in held}, (placements, rank)
