"""Node 0 of a vLLM deployment across two nodes: its ranks read what they would read.

    .venv-vllm/bin/python bench/bench_vllm_node0.py [--tp 4] [--mounts local,cross-region]

vLLM's multi-node start (two ``nnodes`` on one host) does not come up on this CPU
machine, so the node's ranks are emulated: the plugin's dry run (the what-if, one
process per rank, exact on real servers: tests/vllm) gives each of node 0's ranks its
spans, and one process per rank then reads them as vLLM's default loader does, file by
file in its natural order and tensor by tensor in key order, copying each slice out of
the file's mapping (the pages fault in as the weight loaders' copies fault them). The
model is bench_vllm_load's (a dense Llama of 357 MiB in 4 shards) on the emulated
mount, evicted before every run. Neither the model's build nor the dry run is timed
(the same for every arm; the dry run's own time is in bench_vllm_load's table). Arms:

- ``default``: the ranks' copies fault their pages in;
- ``prefetch``: vLLM's ``--safetensors-load-strategy prefetch``: each rank reads whole
  files ``sorted_files[rank::world]`` in a background thread pool while it loads, so
  on a node of two of four ranks, half the files (the other node's ranks prefetch the
  rest, into their own page cache);
- ``spanwarm``: the node's daemon warms the union of the ranks' requests; each rank
  waits for a tensor (or reads it itself where that is sooner) before its copy, as the
  plugin does.

Reported per arm (medians of ``--reps``): the load's wall time (the slowest rank),
bytes read from storage (the mount's counter) and the checkpoint's page cache after it.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import mmap
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_vllm_load import write_model
from bench.span_pages import touched_bytes
from spanwarm.checkpoint.tensor_layout import TensorSpans
from spanwarm.pagecache.residency import evict, file_residency
from spanwarm.testing.slowfs import fuse_available, mount
from spanwarm.testing.spawn import spawn_daemon

ARMS = ("default", "prefetch", "spanwarm")
PREFETCH_THREADS = 8  # vLLM's DEFAULT_SAFETENSORS_PREFETCH_NUM_THREADS
PREFETCH_BLOCK = 16 * 2**20  # and its block size


def node_spans(model: Path, tp: int, node_ranks: list[int]) -> dict[int, list[TensorSpans]]:
    from spanwarm.integrations.vllm.whatif import Layout, deployment_spans

    return deployment_spans(str(model), Layout(tp=tp), node_ranks)


def in_load_order(spans: list[TensorSpans], files: list[str]) -> list[list[TensorSpans]]:
    """The rank's spans grouped by tensor, in the order the default loader hands the
    tensors out (files in natural order, then key order in each)."""
    by_tensor: dict[tuple[str, str], list[TensorSpans]] = {}
    for s in spans:
        by_tensor.setdefault((os.path.basename(s.path), s.tensor), []).append(s)
    order = {name: i for i, name in enumerate(files)}
    return [by_tensor[key] for key in sorted(by_tensor, key=lambda k: (order[k[0]], k[1]))]


def copy_out(view: mmap.mmap, s: TensorSpans) -> int:
    """Copy one span's rows out of the mapping, as a weight loader copies its slice."""
    import numpy as np

    rows = np.lib.stride_tricks.as_strided(
        np.frombuffer(view, dtype=np.uint8, count=1, offset=s.offset),
        shape=(s.count, s.length),
        strides=(s.stride, 1),
    )
    return int(rows.copy().nbytes)


def rank_load(
    arm: str, rank: int, world: int, spans: list[TensorSpans], mounted: str, socket: str, job: str
) -> float:
    """One rank's load (in a process of its own); its wall time."""
    files = sorted({os.path.basename(s.path) for s in spans})
    all_files = sorted(p for p in os.listdir(mounted) if p.endswith(".safetensors"))
    local = [
        dataclasses.replace(s, path=os.path.join(mounted, os.path.basename(s.path))) for s in spans
    ]
    from spanwarm.client import Client  # imported as the plugin loads, before any load
    from spanwarm.integrations.gate import GatedReads

    began = time.monotonic()
    prefetch = None
    gate = None
    if arm == "prefetch":
        pool = concurrent.futures.ThreadPoolExecutor(PREFETCH_THREADS)
        prefetch = [
            pool.submit(_read_whole, os.path.join(mounted, f)) for f in all_files[rank::world]
        ]
    elif arm == "spanwarm":
        client = Client(socket)
        gate = GatedReads(local, client.request(local, job=job, rank=rank), wait_timeout=600)
    maps = {}
    for f in files:
        with open(os.path.join(mounted, f), "rb") as handle:
            maps[f] = mmap.mmap(handle.fileno(), 0, prot=mmap.PROT_READ)
    for tensor in in_load_order(local, files):
        name = tensor[0].tensor
        if gate is not None:
            gate.before_read(name)
        for s in tensor:
            copy_out(maps[os.path.basename(s.path)], s)
        if gate is not None:
            gate.after_read(name)
    elapsed = time.monotonic() - began
    if prefetch is not None:
        for job_done in prefetch:  # vLLM does not wait for it; it only must not outlive us
            job_done.result()
    if gate is not None:
        gate.ticket.cancel()
        client.close()
    return elapsed


def _read_whole(path: str) -> None:
    with open(path, "rb") as f:
        while f.read(PREFETCH_BLOCK):
            pass


def run(
    arm: str,
    fs: Any,
    model: Path,
    spans: dict[int, list[TensorSpans]],
    world: int,
    socket: str,
    rep: int,
) -> dict[str, Any]:
    files = [fs.path(p.name) for p in sorted(model.glob("*.safetensors"))]
    for path in files:
        evict(path)
    before = fs.stats()["bytes"]
    context = multiprocessing.get_context("spawn")
    with context.Pool(len(spans)) as pool:
        walls = pool.starmap(
            rank_load,
            [
                (arm, rank, world, rank_spans, str(fs.path("")), socket, f"node0-{arm}-{rep}")
                for rank, rank_spans in spans.items()
            ],
        )
    cached = sum(file_residency(path)[0] for path in files)
    return {
        "arm": arm,
        "wall_s": max(walls),
        "read_bytes": fs.stats()["bytes"] - before,
        "cached_bytes": cached,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=4, help="the deployment's TP (2 nodes)")
    parser.add_argument("--mounts", default="local,cross-region")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--work", type=Path, default=Path("/var/tmp/spanwarm-bench/vllm"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if (reason := fuse_available()) is not None:
        sys.exit(f"the emulated mount is not available: {reason}")
    args.work.mkdir(parents=True, exist_ok=True)
    model = write_model(args.work / "model")
    node_ranks = list(range(args.tp // 2))
    began = time.monotonic()
    spans = node_spans(model, args.tp, node_ranks)
    print(f"dry runs of ranks {node_ranks} of TP{args.tp}: {time.monotonic() - began:.1f} s")
    touched = _touched(spans)
    size = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    print(f"model {size / 2**20:.0f} MiB; node 0's ranks touch {touched / 2**20:.1f} MiB")
    runs: list[dict[str, Any]] = []
    with spawn_daemon() as daemon:
        for preset in args.mounts.split(","):
            with mount(model, args.work / "mnt", preset) as fs:
                run("spanwarm", fs, model, spans, args.tp, daemon.socket, -1)  # learns the mount
                for rep in range(args.reps):
                    for arm in ARMS:
                        record = {"mount": preset, "rep": rep}
                        record.update(run(arm, fs, model, spans, args.tp, daemon.socket, rep))
                        runs.append(record)
                        print(json.dumps(record), flush=True)
    print(summary(runs, touched))
    if args.json:
        args.json.write_text(json.dumps({"touched": touched, "runs": runs}, indent=1))


def _touched(spans: dict[int, list[TensorSpans]]) -> int:
    return touched_bytes(
        [(s.path, s.offset, s.length, s.stride, s.count) for s in rank_spans]
        for rank_spans in spans.values()
    )


def summary(runs: list[dict[str, Any]], touched: int) -> str:
    lines = [
        "| mount | arm | load (slowest rank) | default / arm (paired) | read from storage "
        "| page cache after |",
        "|---|---|---|---|---|---|",
    ]
    for preset in dict.fromkeys(r["mount"] for r in runs):
        mine = [r for r in runs if r["mount"] == preset]
        default = {r["rep"]: r["wall_s"] for r in mine if r["arm"] == "default"}
        for arm in ARMS:
            these = [r for r in mine if r["arm"] == arm]
            wall = statistics.median(r["wall_s"] for r in these)
            ratio = statistics.median(default[r["rep"]] / r["wall_s"] for r in these)
            read = statistics.median(r["read_bytes"] for r in these)
            cached = statistics.median(r["cached_bytes"] for r in these)
            lines.append(
                f"| {preset} | {arm} | {wall:.2f} s | {ratio:.2f}x | {read / 2**20:.0f} MiB | "
                f"{cached / 2**20:.0f} MiB ({cached / touched:.2f}x touched) |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
