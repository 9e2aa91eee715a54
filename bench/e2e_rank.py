"""One local rank of the end-to-end benchmark (a process with meta DTensors).

    python bench/e2e_rank.py CHECKPOINT --arm none|whole|spanwarm --rank R --local-rank L \
        --local-world LW --world W --layout packed|per-expert --barrier DIR [--socket S]

Builds the rank's meta state dict (TP x FSDP for attention and embeddings, EP for the
experts), waits at a file barrier so that every local rank starts together, then loads
its own slices through safetensors, tensor by tensor:

- ``none``: straight from the checkpoint, cold;
- ``whole``: the seed's base PR: first read ``files[local_rank::local_world]`` whole (4
  threads, 16 MiB reads), then load;
- ``spanwarm``: request the rank's spans from the daemon, wait per tensor, load;
- ``spans``: print the spans ``spanwarm`` would request, as JSON, and exit (no load).

Each slice is copied into new tensors the rank keeps to the end, as a model's load keeps
its weights; with ``--in-place``, into the model's own memory instead, allocated and
zeroed before the barrier (torch DCP loads a state dict in place so).

Prints one JSON line: start time (monotonic clock, comparable across processes),
time to the first tensor, time to the last, bytes of slices loaded, and under
``spanwarm`` the warm phase (start to the last requested tensor ready).
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Placement
from torch.testing._internal.distributed.fake_pg import FakeStore

from spanwarm.checkpoint import placements as model
from spanwarm.checkpoint.resolve import Checkpoint, open_checkpoint
from spanwarm.client import Client, Ticket, rank_spans
from spanwarm.client.rank_spans import model_placements

TP = 4
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "embed_tokens", "lm_head")
PER_EXPERT = re.compile(r"\.experts\.(\d+)\.")
DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def build_state_dict(
    checkpoint: Checkpoint, dense: DeviceMesh, experts: DeviceMesh, num_experts: int
) -> dict[str, tuple[Any, list[Placement], DeviceMesh]]:
    """Checkpoint key -> (meta tensor or DTensor, placements, mesh) for this rank."""
    ep_coordinate = experts.get_coordinate()
    assert ep_coordinate is not None
    per_rank = num_experts // experts.size()
    mine = range(ep_coordinate[0] * per_rank, (ep_coordinate[0] + 1) * per_rank)
    state: dict[str, tuple[Any, list[Placement], DeviceMesh]] = {}
    for name, pieces in checkpoint.pieces.items():
        shape = pieces[0][1].shape
        meta = torch.empty(shape, dtype=torch.bfloat16, device="meta")
        found = PER_EXPERT.search(name)
        if found:  # per-expert layout: the rank holds its own experts whole, no others
            if int(found[1]) in mine:
                state[name] = (meta, [], experts)
            continue
        placements: list[Placement]
        mesh = dense
        if ".experts." in name:  # packed [E, ...]: expert parallel
            placements, mesh = [Shard(0)], experts
        elif len(shape) == 1 or ".mlp.gate." in name:
            placements = [Replicate(), Replicate()]
        elif any(p in name for p in COLUMN_PARALLEL):
            placements = [Shard(0), Shard(0)]
        else:  # o_proj: row parallel, the slice is strided
            placements = [Shard(0), Shard(1)]
        state[name] = (
            distribute_tensor(meta, mesh, placements, src_data_rank=None),
            placements,
            mesh,
        )
    return state


def local_boxes(
    value: Any, placements: list[Placement], mesh: DeviceMesh, shape: Any
) -> list[tuple[slice, ...]]:
    """The index boxes (a slice per dim) of checkpoint tensor ``shape`` this rank loads."""
    if isinstance(value, DTensor):
        coordinate = mesh.get_coordinate()
        assert coordinate is not None
        layout = model_placements(placements)
        assert layout is not None
        runs = model.local_index_runs(shape, mesh.shape, coordinate, layout)
    else:
        runs = tuple(((0, size),) for size in shape)
    return [tuple(slice(a, b) for a, b in box) for box in itertools.product(*runs)]


def model_memory(checkpoint: Checkpoint, state: dict[str, Any]) -> dict[str, list[torch.Tensor]]:
    """Per tensor, zeroed memory for each of its boxes: a model's own weights, allocated
    and written (initialised) before its load copies the checkpoint into them."""
    memory = {}
    for name, (value, placements, mesh) in state.items():
        info = checkpoint.pieces[name][0][1]
        memory[name] = [
            torch.zeros([s.stop - s.start for s in box], dtype=DTYPES[info.dtype])
            for box in local_boxes(value, placements, mesh, info.shape)
        ]
    return memory


def rank_meshes(world: int) -> tuple[DeviceMesh, DeviceMesh]:
    """The dense (FSDP x TP) and expert (EP) meshes, on an initialised process group."""
    return init_device_mesh("cpu", (world // TP, TP)), init_device_mesh("cpu", (world,))


def read_whole(paths: list[str] | list[Path]) -> None:
    """The seed's base PR: read these files whole (4 threads, 16 MiB reads)."""

    def read(path: str | Path) -> None:
        with open(path, "rb", buffering=0) as f:
            while f.read(16 * 2**20):
                pass

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(read, paths))


def start_together(barrier: Path, local_rank: int, local_world: int) -> float:
    """Wait at a file barrier until every local rank is here; the start time (monotonic)."""
    (barrier / f"rank{local_rank}").touch()
    while len(list(barrier.glob("rank*"))) < local_world:
        time.sleep(0.002)
    return time.monotonic()


def rank_arguments() -> argparse.ArgumentParser:
    """The arguments bench_end_to_end.run_local_ranks gives every rank process."""
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--arm", choices=("none", "whole", "spanwarm", "spans"), required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--local-rank", type=int, required=True)
    parser.add_argument("--local-world", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--barrier", type=Path, required=True)
    parser.add_argument("--socket")
    return parser


def main() -> None:
    parser = rank_arguments()
    parser.add_argument("--experts", type=int, required=True)
    parser.add_argument(
        "--in-place",
        action="store_true",
        help="copy into the model's own memory, allocated and zeroed before the barrier "
        "(as torch DCP loads a state dict in place), not into new tensors",
    )
    args = parser.parse_args()

    dist.init_process_group("fake", store=FakeStore(), rank=args.rank, world_size=args.world)
    dense, experts = rank_meshes(args.world)
    checkpoint = open_checkpoint(args.checkpoint)
    state = build_state_dict(checkpoint, dense, experts, args.experts)
    state_dict = {name: value for name, (value, _, _) in state.items()}
    if args.arm == "spans":  # for the limit arm: what this rank would request, and stop
        spans = rank_spans(state_dict, checkpoint, unmatched="skip", first_pages=True)
        print(json.dumps([[s.path, s.offset, s.length, s.stride, s.count] for s in spans]))
        dist.destroy_process_group()
        return

    memory = model_memory(checkpoint, state) if args.in_place else None
    start = start_together(args.barrier, args.local_rank, args.local_world)
    cpu_start = time.process_time()  # the rank's CPU (all threads) from here to the end

    client = None
    ticket = None
    requested = 0.0
    if args.arm == "whole":
        read_whole(checkpoint.paths[args.local_rank :: args.local_world])
    elif args.arm == "spanwarm":
        client = Client(args.socket)
        ticket = client.request_spans(state_dict, args.checkpoint, job="bench", unmatched="skip")
    requested = time.monotonic() - start
    warm: list[float] = []  # the warm phase: request to the last of its tensors ready
    watcher = None
    if ticket is not None and ticket.progress.done:
        warm.append(requested)  # answered in line (all resident): no thread to start
    elif ticket is not None:

        def watch(ticket: Ticket) -> None:
            ticket.wait()
            warm.append(time.monotonic() - start)

        watcher = threading.Thread(target=watch, args=(ticket,), daemon=True)
        watcher.start()

    handles = {}
    weights: list[torch.Tensor] = []  # what this rank loaded, held to the end as a model would
    outcomes: collections.Counter[str] = collections.Counter()
    # Per tensor: name, outcome, bytes loaded, seconds waited, seconds reading.
    tensors: list[tuple[str, str, int, float, float]] = []
    waited = 0.0
    first = None
    loaded = 0
    for name, (value, placements, mesh) in state.items():
        outcome = ""
        waiting = time.monotonic()
        if ticket is not None:
            outcome = ticket.wait_for_read(name)  # as spanwarm's integrations wait
            outcomes[outcome] += 1
        reading = time.monotonic()
        waited += reading - waiting
        before = loaded
        header, info = checkpoint.pieces[name][0]
        if header.path not in handles:
            handles[header.path] = safe_open(header.path, framework="pt")
        view = handles[header.path].get_slice(name)  # type: ignore[no-untyped-call]
        for i, box in enumerate(local_boxes(value, placements, mesh, info.shape)):
            # A slice can be a view of the mapping: copying it reads it.
            if memory is not None:
                loaded += memory[name][i].copy_(view[box]).nbytes
                continue
            # New tensors, kept, as a model's load keeps its weights: each lands in fresh
            # memory. A clone dropped at once let glibc hand the next one the same pages
            # or not, at random per process, which made every arm's resident loads 1x or
            # 2x long.
            weights.append(view[box].clone())
            loaded += weights[-1].nbytes
        tensors.append(
            (name, outcome, loaded - before, reading - waiting, time.monotonic() - reading)
        )
        if ticket is not None:
            if outcome == "read":
                ticket.took(name, time.monotonic() - reading)  # as GatedReads reports
            ticket.consumed([name])
        if first is None:
            first = time.monotonic() - start
    total = time.monotonic() - start
    cpu = time.process_time() - cpu_start
    if watcher is not None:
        watcher.join()
    if client is not None:
        client.close()
    print(
        json.dumps(
            {
                "rank": args.rank,
                "start": start,
                "first_s": first,
                "total_s": total,
                "cpu_s": cpu,
                "bytes": loaded,
                "released": 0 if ticket is None else len(ticket.failures),
                "request_s": requested,
                "warm_s": warm[0] if warm else None,
                "pid": os.getpid(),
                "outcomes": dict(outcomes),  # ready: warmed in time; read: read it itself
                "waited_s": waited,
                "tensors": tensors,
            }
        )
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
