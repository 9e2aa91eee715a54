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
- ``spans``: print the tensor names this rank loads, then the spans ``spanwarm`` would
  request, as JSON lines, and exit (no load);
- ``cattensors``, ``runai``, ``fastsafetensors``, ``instanttensor``: through that loader,
  used as bench/peer_loaders.py describes (cattensors through the same safetensors slices
  as ``none``; the others hand over whole tensors in their own order, from which the rank
  copies its boxes).

Each slice is copied into new tensors the rank keeps to the end, as a model's load keeps
its weights; with ``--in-place``, into the model's own memory instead, allocated and
zeroed before the barrier (torch DCP loads a state dict in place so); with ``--discard``,
into one buffer reused for every slice, as a GPU rank's host memory holds a slice only on
its way to the device (the low-memory scenario: the node's memory holds page cache, not
weights).

Prints one JSON line: start time (monotonic clock, comparable across processes),
time to the first tensor, time to the last, bytes of slices loaded, and under
``spanwarm`` the warm phase (start to the last requested tensor ready).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import itertools
import json
import math
import os
import re
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Placement
from torch.testing._internal.distributed.fake_pg import FakeStore

from spanwarm.checkpoint import placements as model
from spanwarm.checkpoint.resolve import Checkpoint, open_checkpoint
from spanwarm.client import Client, Ticket, rank_spans
from spanwarm.client.rank_spans import model_placements

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import peer_loaders
from bench.memory_cgroup import anonymous_memory

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
    parser.add_argument(
        "--arm",
        choices=("none", "whole", "spanwarm", "spans", *peer_loaders.PEERS),
        required=True,
    )
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--local-rank", type=int, required=True)
    parser.add_argument("--local-world", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--barrier", type=Path, required=True)
    parser.add_argument("--socket")
    return parser


class Destination:
    """Where the rank's slices land: new tensors it keeps, as a model's load keeps its
    weights (the default); the model's own memory, allocated and zeroed before the barrier
    (``--in-place``); or one buffer reused for every slice (``--discard``)."""

    def __init__(
        self, memory: dict[str, list[torch.Tensor]] | None, scratch_bytes: int | None
    ) -> None:
        self.memory = memory
        self.scratch = None
        if scratch_bytes is not None:
            self.scratch = torch.zeros(scratch_bytes, dtype=torch.uint8)
        self.weights: list[torch.Tensor] = []  # held to the end

    def copy(self, name: str, i: int, source: torch.Tensor) -> int:
        """Copy box ``i`` of tensor ``name`` (a view of a mapping or of a loader's buffer:
        copying it reads it); the bytes copied."""
        if self.memory is not None:
            return self.memory[name][i].copy_(source).nbytes
        if self.scratch is not None:
            target = self.scratch[: source.nbytes].view(source.dtype).view(source.shape)
            return target.copy_(source).nbytes
        # New tensors, kept: each lands in fresh memory. A clone dropped at once let glibc
        # hand the next one the same pages or not, at random per process, which made every
        # arm's resident loads 1x or 2x long.
        self.weights.append(source.clone())
        return self.weights[-1].nbytes


@dataclasses.dataclass
class Progress:
    """What a rank's load did, tensor by tensor."""

    start: float
    loaded: int = 0
    first: float | None = None
    waited: float = 0.0
    outcomes: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    # Per tensor: name, outcome, bytes loaded, seconds waited, seconds reading.
    tensors: list[tuple[str, str, int, float, float]] = dataclasses.field(default_factory=list)

    def record(self, name: str, outcome: str, loaded: int, waiting: float, reading: float) -> None:
        """Tensor ``name`` loaded ``loaded`` bytes; it waited from ``waiting`` to ``reading``
        (monotonic times) and read from then to now."""
        now = time.monotonic()
        self.loaded += loaded
        self.waited += reading - waiting
        self.tensors.append((name, outcome, loaded, reading - waiting, now - reading))
        if self.first is None:
            self.first = now - self.start


def all_boxes(
    checkpoint: Checkpoint, state: dict[str, tuple[Any, list[Placement], DeviceMesh]]
) -> dict[str, list[tuple[slice, ...]]]:
    """Per tensor of the rank's state dict, the boxes it loads."""
    return {
        name: local_boxes(value, placements, mesh, checkpoint.pieces[name][0][1].shape)
        for name, (value, placements, mesh) in state.items()
    }


def largest_box(checkpoint: Checkpoint, boxes: dict[str, list[tuple[slice, ...]]]) -> int:
    """Bytes of the largest box the rank loads."""
    return max(
        math.prod(int(s.stop) - int(s.start) for s in box)
        * DTYPES[checkpoint.pieces[name][0][1].dtype].itemsize
        for name, tensor_boxes in boxes.items()
        for box in tensor_boxes
    )


def load_sliced(
    checkpoint: Checkpoint,
    boxes: dict[str, list[tuple[slice, ...]]],
    open_file: Any,
    ticket: Ticket | None,
    destination: Destination,
    progress: Progress,
) -> None:
    """Tensor by tensor in the state dict's order, each box a safetensors slice (after the
    daemon's word on it, under ``spanwarm``)."""
    handles = {}
    for name, tensor_boxes in boxes.items():
        outcome = ""
        waiting = time.monotonic()
        if ticket is not None:
            outcome = ticket.wait_for_read(name)  # as spanwarm's integrations wait
            progress.outcomes[outcome] += 1
        reading = time.monotonic()
        header = checkpoint.pieces[name][0][0]
        if header.path not in handles:
            handles[header.path] = open_file(header.path, framework="pt")
        view = handles[header.path].get_slice(name)
        loaded = sum(destination.copy(name, i, view[box]) for i, box in enumerate(tensor_boxes))
        progress.record(name, outcome, loaded, waiting, reading)
        if ticket is not None:
            if outcome == "read":
                ticket.took(name, time.monotonic() - reading)  # as GatedReads reports
            ticket.consumed([name])


def load_streamed(
    arm: str,
    checkpoint: Checkpoint,
    boxes: dict[str, list[tuple[slice, ...]]],
    destination: Destination,
    progress: Progress,
) -> None:
    """Through a peer loader that hands over whole tensors in its own order: copy the
    rank's boxes out of each before taking the next."""
    paths = sorted({checkpoint.pieces[name][0][0].path for name in boxes})
    waiting = time.monotonic()
    for name, tensor in peer_loaders.stream(arm, paths, list(boxes)):
        reading = time.monotonic()  # the loader's time for this tensor counts as waiting
        loaded = sum(destination.copy(name, i, tensor[box]) for i, box in enumerate(boxes[name]))
        progress.record(name, "", loaded, waiting, reading)
        waiting = time.monotonic()


def main() -> None:
    parser = rank_arguments()
    parser.add_argument("--experts", type=int, required=True)
    places = parser.add_mutually_exclusive_group()
    places.add_argument(
        "--in-place",
        action="store_true",
        help="copy into the model's own memory, allocated and zeroed before the barrier "
        "(as torch DCP loads a state dict in place), not into new tensors",
    )
    places.add_argument(
        "--discard",
        action="store_true",
        help="copy every slice into one reused buffer (a GPU rank's host memory holds a "
        "slice only on its way to the device), not into new tensors",
    )
    args = parser.parse_args()

    dist.init_process_group("fake", store=FakeStore(), rank=args.rank, world_size=args.world)
    dense, experts = rank_meshes(args.world)
    checkpoint = open_checkpoint(args.checkpoint)
    state = build_state_dict(checkpoint, dense, experts, args.experts)
    state_dict = {name: value for name, (value, _, _) in state.items()}
    if args.arm == "spans":  # for the limit arm: what this rank would request, and stop
        spans = rank_spans(state_dict, checkpoint, unmatched="skip", first_pages=True)
        print(json.dumps(list(state_dict)))
        print(json.dumps([[s.path, s.offset, s.length, s.stride, s.count] for s in spans]))
        dist.destroy_process_group()
        return

    boxes = all_boxes(checkpoint, state)
    destination = Destination(
        model_memory(checkpoint, state) if args.in_place else None,
        largest_box(checkpoint, boxes) if args.discard else None,
    )
    open_file = peer_loaders.safe_open_of(args.arm)  # cattensors patches it here
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

    progress = Progress(start)
    if args.arm in peer_loaders.STREAMED:
        load_streamed(args.arm, checkpoint, boxes, destination, progress)
    else:
        load_sliced(checkpoint, boxes, open_file, ticket, destination, progress)
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
                "first_s": progress.first,
                "total_s": total,
                "cpu_s": cpu,
                "bytes": progress.loaded,
                "released": 0 if ticket is None else len(ticket.failures),
                "request_s": requested,
                "warm_s": warm[0] if warm else None,
                "pid": os.getpid(),
                "anon_bytes": anonymous_memory(),
                "outcomes": dict(progress.outcomes),  # ready: warmed in time; read: itself
                "waited_s": progress.waited,
                "tensors": progress.tensors,
            }
        )
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
