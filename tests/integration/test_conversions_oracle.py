"""spanwarm.checkpoint.conversions.read_runs against transformers' own shard-on-read.

transformers' ``DtensorShardOperation`` is driven with a slice object that records every
index it is asked for, on real meta DTensors (torch's fake process group, one process),
for each rank of 1-D and 2-D meshes, placements of every kind that transformers uses
(uneven sizes included), dense sources, converted sources of another shape, and
per-expert pieces of a stack. The elements it reads must be exactly the ones spanwarm
says it reads.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any, cast

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # noqa: E402
from torch.distributed.tensor.placement_types import Replicate as TorchReplicate  # noqa: E402
from torch.distributed.tensor.placement_types import Shard as TorchShard  # noqa: E402
from torch.distributed.tensor.placement_types import _StridedShard  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402
from transformers.distributed.sharding_utils import DtensorShardOperation  # noqa: E402

from spanwarm.checkpoint.conversions import read_runs  # noqa: E402
from spanwarm.client.rank_spans import model_placements  # noqa: E402


class RecordingSource:
    """Stands in for a safetensors slice: records the elements each read touches."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape
        self.elements: set[int] = set()

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def __getitem__(self, index: Any) -> Any:
        index = () if index is Ellipsis else index
        padded = [*index, *[slice(None)] * (len(self.shape) - len(index))]
        ranges = [range(*s.indices(n)) for s, n in zip(padded, self.shape, strict=True)]
        grid = np.arange(int(np.prod(self.shape)), dtype=np.int64).reshape(self.shape)
        picked = grid[np.ix_(*[np.asarray(r, dtype=np.int64) for r in ranges])]
        self.elements.update(picked.ravel().tolist())
        return torch.zeros(picked.shape)


def _elements(shape: tuple[int, ...], runs: Any) -> set[int]:
    if runs is False:
        return set()
    if runs is None:
        return set(range(int(np.prod(shape))))
    grid = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
    axes = [
        np.concatenate([np.arange(a, b) for a, b in r] or [np.zeros(0, np.int64)]) for r in runs
    ]
    return set(grid[np.ix_(*axes)].ravel().tolist())


MESHES = {(4,): ("tp",), (2, 2): ("fsdp", "tp")}
SHARDS_1D = [
    (TorchShard(0),),
    (TorchShard(1),),
    (TorchShard(2),),
    (_StridedShard(1, split_factor=2),),
    (_StridedShard(0, split_factor=2),),
    (TorchReplicate(),),
]
SHARDS_2D = [
    (_StridedShard(0, split_factor=2), TorchShard(0)),
    (TorchShard(0), TorchShard(1)),
    (TorchShard(0), TorchShard(2)),
    (TorchShard(0), _StridedShard(1, split_factor=2)),
    (TorchShard(0), TorchReplicate()),
    (TorchReplicate(), TorchShard(0)),
]


def _param(mesh: Any, placements: tuple[Any, ...], shape: tuple[int, ...]) -> DTensor:
    local_shape, _ = compute_local_shape_and_global_offset(shape, mesh, placements)
    stride = tuple(int(np.prod(shape[i + 1 :])) for i in range(len(shape)))
    return DTensor.from_local(
        torch.empty(local_shape, device="meta"),
        mesh,
        placements,
        run_check=False,
        shape=torch.Size(shape),
        stride=stride,
    )


@pytest.fixture
def fake_world() -> Iterator[Any]:
    def start(rank: int, world: int) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("mesh_shape", list(MESHES))
def test_read_runs_match_transformers_shard_on_read(fake_world: Any, mesh_shape: Any) -> None:
    world = int(np.prod(mesh_shape))
    choices = SHARDS_1D if len(mesh_shape) == 1 else SHARDS_2D
    target = (6, 10, 7)  # uneven over 2 and 4 on every dim
    sources = {
        "dense": (target, None),  # the tensor itself
        "chunked": ((6, 30, 7), None),  # a fused source three times as wide on dim 1
        **{f"expert{e}": (target[1:], e) for e in (0, 2, 5, 9)},  # 9: wraps around 6
    }
    checked = skipped = 0
    for rank in range(world):
        fake_world(rank, world)
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=MESHES[mesh_shape])
        coordinate = mesh.get_coordinate()
        assert coordinate is not None
        for placements, (label, (shape, index)) in itertools.product(choices, sources.items()):
            operation = DtensorShardOperation(_param(mesh, placements, target))
            source = RecordingSource(shape)
            try:
                operation.shard_tensor(cast(Any, source), tensor_idx=index)
            except (ValueError, IndexError):
                skipped += 1  # transformers cannot load this combination either
                continue
            ours_placements = model_placements(placements)
            assert ours_placements is not None
            ours = read_runs(shape, target, mesh_shape, coordinate, ours_placements, index)
            assert _elements(shape, ours) == source.elements, (rank, placements, label)
            checked += 1
    assert checked > 10 * skipped, (checked, skipped)
