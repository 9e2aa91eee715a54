"""What ``request_spans`` costs a fresh rank process whose checkpoint is resident.

    .venv/bin/python bench/bench_request_cost.py [--layout per-expert|packed] [--reps 10]
        [--base-src /tmp/base/src]   # another tree's client, interleaved (git worktree add)

Each run is a new process (rank 0 of bench_end_to_end.py's 8, a fake process group, its
state dict built and the checkpoint opened first, as e2e_rank.py does before its barrier)
that reads the checkpoint through the page cache and then times, once each, as a loader's
rank would call them: ``rank_spans`` and ``Client.request`` (spans to ticket: the in-line
residency check; a resident checkpoint is answered there, with no thread and no RPC).
A fresh process because a rank makes its request once: first calls (caches empty, the
interpreter not yet specialised) are what it pays. The daemon is the one
``spawn_daemon`` starts. Prints the medians of each, and of runs where every tensor was
found resident (idle reclaim can take pages between the read and the check).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def one_rank(layout: str, data: Path, socket: str) -> None:
    """In the child: build rank 0's state dict, read the checkpoint, time the request."""
    sys.path.insert(0, str(ROOT))
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from bench import e2e_rank
    from bench.bench_end_to_end import EXPERTS, WORLD, touch_every_page
    from spanwarm.checkpoint.resolve import open_checkpoint
    from spanwarm.client import Client, rank_spans

    source = data / f"moe-{layout}"
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    meshes = e2e_rank.rank_meshes(WORLD)
    checkpoint = open_checkpoint(source)
    state = e2e_rank.build_state_dict(checkpoint, *meshes, EXPERTS)
    state_dict = {name: value for name, (value, _, _) in state.items()}
    touch_every_page([Path(p) for p in checkpoint.paths])
    client = Client(socket)
    began = time.perf_counter()
    spans = rank_spans(state_dict, source, unmatched="skip")
    spanned = time.perf_counter()
    ticket = client.request(spans, job="bench")
    requested = time.perf_counter()
    progress = ticket.progress
    print(
        json.dumps(
            {
                "rank_spans_ms": 1e3 * (spanned - began),
                "request_ms": 1e3 * (requested - spanned),
                "total_ms": 1e3 * (requested - began),
                "resident": progress.resident == progress.groups,
            }
        )
    )
    ticket.cancel()
    client.close()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layout", default="per-expert", choices=("per-expert", "packed"))
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--data", type=Path, default=Path("/var/tmp/spanwarm-bench"))
    parser.add_argument("--base-src", help="another tree's src: its client, interleaved")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # the daemon's socket, in a run
    args = parser.parse_args()
    if args.child:
        one_rank(args.layout, args.data, args.child)
        return

    sys.path.insert(0, str(ROOT))
    from bench.bench_end_to_end import build_checkpoint
    from spanwarm.testing.spawn import spawn_daemon

    build_checkpoint(args.data / f"moe-{args.layout}", args.layout)
    trees = {"this tree": None, **({"base": args.base_src} if args.base_src else {})}
    runs: dict[str, list[dict[str, float]]] = {tree: [] for tree in trees}
    with spawn_daemon("--log-level", "warning") as daemon:
        for rep in range(args.reps):
            order = list(trees.items())
            for tree, src in order if rep % 2 == 0 else order[::-1]:
                env = {**os.environ, "OMP_NUM_THREADS": "1"}
                if src is not None:
                    env["PYTHONPATH"] = src  # before the editable install's path
                command = [sys.executable, __file__, "--layout", args.layout]
                command += ["--data", str(args.data), "--child", daemon.socket]
                out = subprocess.run(
                    command, env=env, cwd=ROOT, capture_output=True, text=True, check=True
                ).stdout
                runs[tree].append(json.loads(out.splitlines()[-1]))
    for tree, rs in runs.items():
        resident = [r for r in rs if r["resident"]]
        line = ", ".join(
            f"{key[:-3]} {statistics.median(r[key] for r in rs):.2f} ms"
            for key in ("rank_spans_ms", "request_ms", "total_ms")
        )
        every = statistics.median(r["total_ms"] for r in resident) if resident else float("nan")
        print(
            f"{tree}: {line} (medians of {len(rs)}); all resident in {len(resident)}: "
            f"total {every:.2f} ms"
        )


if __name__ == "__main__":
    main()
