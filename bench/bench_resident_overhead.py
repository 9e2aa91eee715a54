"""What spanwarm costs a rank whose checkpoint is already in the page cache, in-process.

    python bench/bench_resident_overhead.py [--layout per-expert|packed] [--reps 20]
    PYTHONPATH=/tmp/base/src python bench/bench_resident_overhead.py   # another tree's client

One rank (rank 0 of bench_end_to_end.py's 8, a fake process group) loads its slices of the
end-to-end benchmark's checkpoint through safetensors, tensor by tensor, with the
checkpoint resident: ``none`` straight away, ``spanwarm`` through ``request_spans`` and
``wait_for_read`` against a real daemon, as e2e_rank.py does. Arms alternate in one
process, so there is no interpreter start, no second rank and no barrier in the figures:
what is left is the client's own cost (spans, residency, its threads), which a two-rank
run's walls (0.3-1.4 s for the same load on this VM) bury. Prints medians of wall and
CPU (all threads) per arm and the paired none/spanwarm wall ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:  # run as a script: bench/ is on the path, not its parent
    sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from safetensors import safe_open  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402

from bench import e2e_rank  # noqa: E402
from bench.bench_end_to_end import EXPERTS, WORLD, build_checkpoint  # noqa: E402
from spanwarm.checkpoint.resolve import open_checkpoint  # noqa: E402
from spanwarm.client import Client  # noqa: E402
from spanwarm.testing.spawn import spawn_daemon  # noqa: E402


def load(checkpoint_dir: Path, socket: str | None, meshes: tuple[Any, Any]) -> tuple[float, float]:
    """One rank's load (wall, CPU seconds): through spanwarm when ``socket`` is given."""
    checkpoint = open_checkpoint(checkpoint_dir)
    state = e2e_rank.build_state_dict(checkpoint, *meshes, EXPERTS)
    state_dict = {name: value for name, (value, _, _) in state.items()}
    wall, cpu = time.monotonic(), time.process_time()
    client = ticket = None
    if socket is not None:
        client = Client(socket)
        ticket = client.request_spans(state_dict, checkpoint_dir, job="bench", unmatched="skip")
    handles = {}
    weights: list[torch.Tensor] = []  # held to the end, as a model holds its weights
    for name, (value, placements, mesh) in state.items():
        if ticket is not None:
            ticket.wait_for_read(name)
        header, info = checkpoint.pieces[name][0]
        if header.path not in handles:
            handles[header.path] = safe_open(header.path, framework="pt")
        view = handles[header.path].get_slice(name)  # type: ignore[no-untyped-call]
        boxes = e2e_rank.local_boxes(value, placements, mesh, info.shape)
        weights.extend(view[box].clone() for box in boxes)
        if ticket is not None:
            ticket.consumed([name])
    wall, cpu = time.monotonic() - wall, time.process_time() - cpu
    del weights
    if ticket is not None and client is not None:
        ticket.cancel()
        client.close()
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layout", default="per-expert", choices=("per-expert", "packed"))
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--data", type=Path, default=Path("/var/tmp/spanwarm-bench"))
    args = parser.parse_args()
    source = args.data / f"moe-{args.layout}"
    build_checkpoint(source, args.layout)
    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    meshes = e2e_rank.rank_meshes(WORLD)
    runs: dict[str, list[tuple[float, float]]] = {"none": [], "spanwarm": []}
    with spawn_daemon("--log-level", "warning") as daemon:
        for path in source.glob("*.safetensors"):
            path.read_bytes()
        load(source, daemon.socket, meshes)  # imports, the daemon's first request
        for rep in range(args.reps):
            for arm in ("none", "spanwarm") if rep % 2 else ("spanwarm", "none"):
                socket = daemon.socket if arm == "spanwarm" else None
                runs[arm].append(load(source, socket, meshes))
    for arm, rs in runs.items():
        wall = statistics.median(r[0] for r in rs)
        cpu = statistics.median(r[1] for r in rs)
        print(f"{arm}: wall {1e3 * wall:.1f} ms, CPU {1e3 * cpu:.1f} ms (medians)")
    pairs = zip(runs["none"], runs["spanwarm"], strict=True)
    print(f"paired none/spanwarm wall: {statistics.median(a[0] / b[0] for a, b in pairs):.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
