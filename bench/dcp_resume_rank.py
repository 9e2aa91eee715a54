"""One process of bench_dcp_resume.py: a rank of the training job that saves the
checkpoint, or one local rank of the job that resumes from it.

    python -m torch.distributed.run --standalone --nproc_per_node 4 \
        bench/dcp_resume_rank.py save OUT
    python bench/dcp_resume_rank.py CHECKPOINT --arm none|spanwarm --rank R --local-rank L \
        --local-world LW --world W --barrier DIR [--socket S]

The state dict is a training job's (``MODEL``: a 3-layer transformer, bf16 parameters,
uneven vocabulary and FFN sizes): ``model`` (the parameters), ``optim.state`` (per
parameter ``exp_avg`` and ``exp_avg_sq`` in f32, and Adam's ``step``, a plain scalar tensor
that DCP stores once) and ``step`` (an int, stored as bytes). Every value is a hash of its
global index and of a seed per tensor, an exact bf16/f32 number: any rank computes any slice
of it without the rest, so each saving rank writes its own shard and each resuming rank
checks exactly what it loaded.

- ``save``: each of the 4 ranks holds an FSDP-like shard (``Shard(0)`` on a mesh of 4) and
  ``dcp.save`` writes DCP's native format (``FileSystemWriter``: one ``.distcp`` per rank and
  ``.metadata``).
- load: W gloo ranks (a ``file://`` store in DIR) build a TP-like layout on a mesh of W
  (column-parallel and embedding weights ``Shard(0)``, row-parallel ``Shard(1)``, norms
  replicated; optimizer states as their parameter), filled with NaN; under ``spanwarm``
  they ``spanwarm.integrations.dcp.enable`` the node's daemon. After a barrier each times its
  ``dcp.load(state, checkpoint_id=CHECKPOINT)``, then checks every value it loaded and exits
  1, naming the wrong ones, if any differs.

A load prints one JSON line: start (monotonic clock, comparable across processes), seconds
to load and, under ``spanwarm``, the seconds its reads waited for readiness, the bytes
requested and how many of the request's items the daemon reported warm.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

# Run as a script, bench/ is on the path but its parent (for bench.e2e_rank) is not.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Placement

import spanwarm.integrations.dcp as spanwarm_dcp
from bench.e2e_rank import rank_arguments
from spanwarm.client import Client

HIDDEN, FFN, VOCAB, LAYERS = 1536, 4099, 16003, 3
STEP = 1000
OPTIMIZER_STATES = ("exp_avg", "exp_avg_sq")
COLWISE, ROWWISE, REPLICATE = "colwise", "rowwise", "replicate"


def model() -> dict[str, tuple[tuple[int, ...], str]]:
    """Parameter -> (shape, how the resumed job shards it on its 1-D mesh)."""
    params: dict[str, tuple[tuple[int, ...], str]] = {
        "tok_embeddings.weight": ((VOCAB, HIDDEN), COLWISE)
    }
    for i in range(LAYERS):
        p = f"layers.{i}"
        params |= {
            f"{p}.attention_norm.weight": ((HIDDEN,), REPLICATE),
            f"{p}.attention.wq.weight": ((HIDDEN, HIDDEN), COLWISE),
            f"{p}.attention.wk.weight": ((HIDDEN // 3, HIDDEN), COLWISE),
            f"{p}.attention.wv.weight": ((HIDDEN // 3, HIDDEN), COLWISE),
            f"{p}.attention.wo.weight": ((HIDDEN, HIDDEN), ROWWISE),
            f"{p}.ffn_norm.weight": ((HIDDEN,), REPLICATE),
            f"{p}.feed_forward.w1.weight": ((FFN, HIDDEN), COLWISE),
            f"{p}.feed_forward.w2.weight": ((HIDDEN, FFN), ROWWISE),
            f"{p}.feed_forward.w3.weight": ((FFN, HIDDEN), COLWISE),
        }
    params["norm.weight"] = ((HIDDEN,), REPLICATE)
    params["output.weight"] = ((VOCAB, HIDDEN), COLWISE)
    return params


MODEL = model()


def entries() -> Iterator[tuple[tuple[str, ...], tuple[int, ...], torch.dtype, str, int]]:
    """Every sharded tensor of the state dict: (path in the nested state dict, global
    shape, dtype, resume layout, seed of its values)."""
    seed = 0
    for name, (shape, layout) in MODEL.items():
        yield ("model", name), shape, torch.bfloat16, layout, seed
        seed += 1
        for state in OPTIMIZER_STATES:
            yield ("optim", "state", name, state), shape, torch.float32, layout, seed
            seed += 1


def checkpoint_bytes() -> int:
    """Bytes of tensor data in the checkpoint (DCP adds a little per stored chunk)."""
    return sum(math.prod(shape) * dtype.itemsize for _, shape, dtype, _, _ in entries())


def values(
    seed: int, shape: tuple[int, ...], offset: tuple[int, ...], local: tuple[int, ...]
) -> torch.Tensor:
    """The slice ``[offset, offset + local)`` of tensor ``seed`` (global ``shape``), in f32:
    a 32-bit hash of the seed and the flat global index, 256 values in [-8, 8) by 1/16,
    exact in bf16 too. Products stay below 2**62: no int64 overflow."""
    index = torch.full(local, seed << 25, dtype=torch.int64)  # every tensor < 2**25 elements
    stride = 1
    for dim in reversed(range(len(shape))):
        axis = torch.arange(offset[dim], offset[dim] + local[dim], dtype=torch.int64) * stride
        index += axis.view(*([1] * dim), local[dim], *([1] * (len(shape) - dim - 1)))
        stride *= shape[dim]
    for multiplier, shift in ((0x2C1B3C6D, 12), (0x297A2D39, 15)):
        index *= multiplier
        index &= 0xFFFFFFFF
        index ^= index >> shift
    index &= 0xFF
    return index.to(torch.float32) / 16 - 8


def resume_placements(layout: str) -> list[Placement]:
    placements: dict[str, list[Placement]] = {
        COLWISE: [Shard(0)],
        ROWWISE: [Shard(1)],
        REPLICATE: [Replicate()],
    }
    return placements[layout]


def local_slice(
    shape: tuple[int, ...], mesh: DeviceMesh, placements: list[Placement]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local shape, global offset) of this rank's slice."""
    local, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
    return tuple(local), tuple(offset)


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(math.prod(shape[d + 1 :]) for d in range(len(shape)))


def put(state: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        state = state.setdefault(key, {})
    state[path[-1]] = value


def get(state: dict[str, Any], path: tuple[str, ...]) -> Any:
    value: Any = state
    for key in path:
        value = value[key]
    return value


def sharded(
    mesh: DeviceMesh, placements: list[Placement], shape: tuple[int, ...], local: torch.Tensor
) -> DTensor:
    return DTensor.from_local(
        local,
        mesh,
        placements,
        run_check=False,
        shape=torch.Size(shape),
        stride=contiguous_stride(shape),
    )


def save(out: Path) -> None:
    """This rank's FSDP shard of the training state, saved with every other rank's."""
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fsdp: list[Placement] = [Shard(0)]
    state: dict[str, Any] = {"step": STEP}
    for path, shape, dtype, _, seed in entries():
        local, offset = local_slice(shape, mesh, fsdp)
        put(state, path, sharded(mesh, fsdp, shape, values(seed, shape, offset, local).to(dtype)))
    for name in MODEL:  # every rank has the same: DCP stores it once
        put(state, ("optim", "state", name, "step"), torch.tensor(float(STEP)))
    dcp_save(state, checkpoint_id=str(out))
    dist.destroy_process_group()


def targets(mesh: DeviceMesh) -> dict[str, Any]:
    """The resumed job's state dict, in its own layout, every value NaN (and step -1)."""
    state: dict[str, Any] = {"step": -1}
    for path, shape, dtype, layout, _ in entries():
        placements = resume_placements(layout)
        local, _ = local_slice(shape, mesh, placements)
        put(state, path, sharded(mesh, placements, shape, torch.full(local, math.nan, dtype=dtype)))
    for name in MODEL:
        put(state, ("optim", "state", name, "step"), torch.tensor(math.nan))
    return state


def wrong_values(state: dict[str, Any], mesh: DeviceMesh) -> list[str]:
    """The state dict entries this rank loaded that differ from what was saved."""
    wrong = [] if state["step"] == STEP else ["step"]
    for path, shape, dtype, layout, seed in entries():
        value = get(state, path)
        local, offset = local_slice(shape, mesh, resume_placements(layout))
        expected = values(seed, shape, offset, local).to(dtype)
        if not torch.equal(value.to_local(), expected):
            wrong.append(".".join(path))
    wrong += [
        f"optim.state.{name}.step"
        for name in MODEL
        if get(state, ("optim", "state", name, "step")).item() != STEP
    ]
    return wrong


def load() -> None:
    parser = rank_arguments()
    args = parser.parse_args()
    if args.arm not in ("none", "spanwarm"):
        parser.error(f"--arm {args.arm}: this benchmark has none and spanwarm")
    dist.init_process_group(
        "gloo",
        init_method=f"file://{args.barrier / 'store'}",
        rank=args.rank,
        world_size=args.world,
        timeout=timedelta(minutes=5),  # a rank that failed must not hang the other for long
    )
    mesh = init_device_mesh("cpu", (args.world,))
    state = targets(mesh)
    session = None
    if args.arm == "spanwarm":
        session = spanwarm_dcp.enable(Client(args.socket), job="bench-dcp-resume")

    dist.barrier()
    start = time.monotonic()
    dcp_load(state, checkpoint_id=str(args.checkpoint))
    total = time.monotonic() - start

    result: dict[str, Any] = {"rank": args.rank, "start": start, "total_s": total}
    if session is not None:
        loads = [prefetched for reader in session.readers for prefetched in reader.loads]
        if not loads:
            sys.exit(f"rank {args.rank}: spanwarm did not prefetch this load")
        progress = [prefetched.ticket.progress for prefetched in loads]
        result |= {
            "waited_s": sum(prefetched.waited_s for prefetched in loads),
            "requested_bytes": sum(prefetched.requested_bytes for prefetched in loads),
            "items": sum(p.groups for p in progress),
            "warm": sum(p.ready for p in progress),
            "failed": sum(p.failed for p in progress),
        }
    wrong = wrong_values(state, mesh)
    if wrong:
        sys.exit(f"rank {args.rank} ({args.arm}): {len(wrong)} wrong values: {wrong[:8]}")
    print(json.dumps(result), flush=True)
    dist.destroy_process_group()


def main() -> None:
    if sys.argv[1:2] == ["save"]:
        save(Path(sys.argv[2]))
    else:
        load()


if __name__ == "__main__":
    main()
    # Without the interpreter's teardown: a gloo worker thread still destroying a finished
    # collective's work then needs the GIL and aborts the rank (pytorch/pytorch#190489).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
