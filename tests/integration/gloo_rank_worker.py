"""One rank of the torchrun test: real gloo DTensors, spans read back from the file."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from spanwarm.client import rank_spans
from tests.integration.rank_exit import exit_rank

PLACEMENTS: dict[str, list[Placement]] = {
    "w_rowwise": [_StridedShard(0, split_factor=2), Shard(0)],
    "w_colwise": [Replicate(), Shard(1)],
    "w_mixed": [Shard(0), Shard(1)],
}


def main(checkpoint: Path, out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2))
    weights = torch.load(checkpoint.with_suffix(".pt"))
    raw = np.frombuffer(checkpoint.read_bytes(), dtype=np.uint8)
    result = {}
    for name, placements in PLACEMENTS.items():
        dtensor = distribute_tensor(weights[name], mesh, placements)  # scattered from rank 0
        spans = rank_spans({name: dtensor}, checkpoint, unmatched="skip")
        positions = sorted({b for s in spans for a, e in s.span.intervals() for b in range(a, e)})
        local = dtensor.to_local().contiguous().view(torch.uint8).numpy().tobytes()
        result[name] = {
            "equal": raw[positions].tobytes() == local,
            "bytes": len(positions),
            "spans": len(spans),
        }
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
    exit_rank()
