"""Why a resident load's wall depends on what the loader does with its copies.

    python bench/bench_resident_copies.py [--layout per-expert|packed] [--runs 6]

Rank 0 of bench_end_to_end.py's 8 (a fake process group), alone, no spanwarm, loads its
slices of the resident checkpoint as ``e2e_rank.py`` does, in a fresh process per run,
three ways: each copy dropped at once (what ``e2e_rank.py`` did until 2026-12-06), every
copy kept to the end (a model's load: new tensors), and copied into memory allocated
and zeroed before the load (``--in-place``: torch DCP's load into a state dict). Prints
per run the load's wall, its minor faults and the median copy of a tensor of 2 MiB or
more: dropped copies let glibc hand the next one the same pages or fresh ones, at random
per process, and each fresh page faults in.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MODES = ("dropped", "kept", "in-place")


def one_run(layout: str, data: Path, mode: str) -> None:
    """In the child: load rank 0's slices once, copies treated as ``mode`` says."""
    sys.path.insert(0, str(ROOT))
    import torch
    import torch.distributed as dist
    from safetensors import safe_open
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from bench import e2e_rank
    from bench.bench_end_to_end import EXPERTS, WORLD, touch_every_page
    from spanwarm.checkpoint.resolve import open_checkpoint

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    checkpoint = open_checkpoint(data / f"moe-{layout}")
    state = e2e_rank.build_state_dict(checkpoint, *e2e_rank.rank_meshes(WORLD), EXPERTS)
    memory = e2e_rank.model_memory(checkpoint, state) if mode == "in-place" else None
    touch_every_page([Path(p) for p in checkpoint.paths])
    kept: list[torch.Tensor] = []
    big: list[float] = []  # seconds per copy of a slice of 2 MiB or more
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.monotonic()
    handles = {}
    for name, (value, placements, mesh) in state.items():
        header, info = checkpoint.pieces[name][0]
        if header.path not in handles:
            handles[header.path] = safe_open(header.path, framework="pt")
        view = handles[header.path].get_slice(name)  # type: ignore[no-untyped-call]
        for i, box in enumerate(e2e_rank.local_boxes(value, placements, mesh, info.shape)):
            began = time.monotonic()
            if memory is not None:
                copy = memory[name][i].copy_(view[box])
            else:
                copy = view[box].clone()
                if mode == "kept":
                    kept.append(copy)
            if copy.nbytes >= 2**21:
                big.append(time.monotonic() - began)
    wall = time.monotonic() - start
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    copy_ms = 1e3 * statistics.median(big)
    print(json.dumps({"wall_ms": 1e3 * wall, "faults": faults, "copy_ms": copy_ms}))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layout", default="per-expert", choices=("per-expert", "packed"))
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--data", type=Path, default=Path("/var/tmp/spanwarm-bench"))
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        one_run(args.layout, args.data, args.child)
        return
    sys.path.insert(0, str(ROOT))
    from bench.bench_end_to_end import build_checkpoint

    build_checkpoint(args.data / f"moe-{args.layout}", args.layout)
    print("| copies | load (ms) | minor faults | a 2 MiB+ slice's copy (median, ms) |")
    print("| --- | --- | --- | --- |")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for mode in MODES:
        runs = []
        for _ in range(args.runs):
            command = [sys.executable, __file__, "--layout", args.layout, "--child", mode]
            command += ["--data", str(args.data)]
            out = subprocess.run(
                command, env=env, cwd=ROOT, capture_output=True, text=True, check=True
            ).stdout
            runs.append(json.loads(out.splitlines()[-1]))
        walls = ", ".join(f"{r['wall_ms']:.0f}" for r in runs)
        faults = ", ".join(f"{r['faults'] / 1e3:.1f}k" for r in runs)
        copies = ", ".join(f"{r['copy_ms']:.2f}" for r in runs)
        print(f"| {mode} | {walls} | {faults} | {copies} |")


if __name__ == "__main__":
    main()
