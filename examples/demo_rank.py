"""One rank of the demo job: meta DTensors -> request spans -> load each slice when ready.

    python examples/demo_rank.py CHECKPOINT SOCKET --rank R --world W --local-world L \\
        --mesh FSDPxTP --barrier DIR

Prints one JSON line: time to first tensor, time to all, bytes this rank read.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from spanwarm.checkpoint.placements import Shard as ModelShard
from spanwarm.checkpoint.placements import local_index_runs
from spanwarm.checkpoint.resolve import open_checkpoint
from spanwarm.client import Client

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")


def shard_dims(name: str, ndim: int) -> tuple[int, int]:
    """Tensor dim sharded on each mesh dim: FSDP shards dim 0; TP shards rows of
    column-parallel weights and columns of row-parallel ones."""
    if ndim == 1 or any(p in name for p in COLUMN_PARALLEL):
        return (0, 0)
    return (0, 1)


def start_together(directory: Path, rank: int, local_world: int) -> None:
    """The node's ranks request their spans at the same moment, as after a real barrier."""
    (directory / f"rank{rank}").touch()
    while len(list(directory.glob("rank*"))) < local_world:
        time.sleep(0.005)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("socket")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--mesh", required=True)
    parser.add_argument("--local-world", type=int, required=True)
    parser.add_argument("--barrier", type=Path, required=True, help="directory for the start line")
    args = parser.parse_args()
    mesh_shape = tuple(int(d) for d in args.mesh.split("x"))

    # A fake process group: this process plays one rank of a multi-node job.
    dist.init_process_group("fake", store=FakeStore(), rank=args.rank, world_size=args.world)
    mesh = init_device_mesh("cpu", mesh_shape)
    checkpoint = open_checkpoint(args.checkpoint)
    state_dict = {}
    for name, pieces in checkpoint.pieces.items():
        info = pieces[0][1]
        meta = torch.empty(info.shape, dtype=torch.bfloat16, device="meta")
        placements = [Shard(d) for d in shard_dims(name, len(info.shape))]
        state_dict[name] = distribute_tensor(meta, mesh, placements, src_data_rank=None)

    start_together(args.barrier, args.rank, args.local_world)
    client = Client(args.socket)
    start = time.monotonic()
    ticket = client.request_spans(state_dict, args.checkpoint, job="demo")
    first = None
    read = 0
    coordinate = mesh.get_coordinate()
    assert coordinate is not None
    for name in state_dict:
        ticket.wait([name])
        header, info = checkpoint.pieces[name][0]
        layout = [ModelShard(d) for d in shard_dims(name, len(info.shape))]
        runs = local_index_runs(info.shape, mesh_shape, coordinate, layout)
        with safe_open(header.path, framework="pt") as f:
            view = f.get_slice(name)
            for box in itertools.product(*runs):
                read += view[tuple(slice(a, b) for a, b in box)].clone().nbytes
        ticket.consumed([name])  # under a memory budget, warming moves on
        if first is None:
            first = time.monotonic() - start
    total = time.monotonic() - start
    client.close()
    print(
        json.dumps(
            {
                "rank": args.rank,
                "first_s": first,
                "total_s": total,
                "bytes": read,
                "tensors": len(state_dict),
                "released": len(ticket.failures),
            }
        )
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
