"""Paired A/B of two daemon builds on the end-to-end scenario (bench_end_to_end.py).

    .venv/bin/python bench/bench_daemon_ab.py --base-src /tmp/base/src \\
        [--mounts cross-region] [--layouts packed,per-expert] [--reps 5]

``--base-src`` is the ``src`` directory of another checkout (``git worktree add /tmp/base
<commit>``): its daemon runs with ``PYTHONPATH`` there, beside one of this tree's, both on
the same emulated mount. Each repetition runs the spanwarm arm against each daemon and
the limit arm, in a shuffled order; the ranks are this tree's. Printed per mount and
layout: median walls, end to end and warm phase against the limit, the paired base/new
wall ratio (above 1: this tree is faster), and each daemon's CPU per load.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: bench/ is on the path, its parent is not
    sys.path.insert(0, str(ROOT))

from bench import bench_end_to_end as e2e  # noqa: E402
from spanwarm.testing.spawn import spawn_daemon  # noqa: E402


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100  # utime + stime, in clock ticks


def compare(source: Path, preset: str, base_src: str, reps: int, rng: random.Random) -> Any:
    flags = ("--log-level", "warning", "--state-dir")
    with (
        e2e.mounted(source, preset) as (checkpoint, fs),
        spawn_daemon(*flags, tempfile.mkdtemp(), env={"PYTHONPATH": base_src}) as base,
        spawn_daemon(*flags, tempfile.mkdtemp()) as new,
    ):
        paths = sorted(checkpoint.glob("*.safetensors"))
        daemons = {"base": base, "new": new}
        seek_costs = {}
        for name, daemon in daemons.items():  # each one's first load, then its probe
            e2e.run_arm("spanwarm", checkpoint, paths, daemon.socket, fs)
            seek_costs[name] = e2e.probed_seek_cost(daemon.socket, paths[0], [])
        print(f"  {preset}: seek costs {seek_costs}", flush=True)
        limit_runs = e2e.node_runs(checkpoint, seek_costs["new"])  # as bench_end_to_end
        runs: dict[str, list[dict[str, Any]]] = {"base": [], "new": [], "limit": []}
        for rep in range(reps):
            for arm in rng.sample(sorted(runs), len(runs)):
                if arm == "limit":
                    result = e2e.run_limit(limit_runs, paths, fs)
                else:
                    pid = daemons[arm].process.pid
                    before = cpu_seconds(pid)
                    result = e2e.run_arm("spanwarm", checkpoint, paths, daemons[arm].socket, fs)
                    result["daemon_cpu_s"] = cpu_seconds(pid) - before
                runs[arm].append(result)
                print(f"  {preset} rep {rep} {arm}: {result['wall_s']:.2f} s", flush=True)

    def paired(a: str, b: str, key: str = "wall_s") -> float:
        return float(statistics.median(runs[a][i][key] / runs[b][i]["wall_s"] for i in range(reps)))

    return {
        "wall_s": {arm: statistics.median(r["wall_s"] for r in rs) for arm, rs in runs.items()},
        "end_to_end/limit": {arm: paired(arm, "limit") for arm in ("base", "new")},
        "warm_phase/limit": {arm: paired(arm, "limit", "warm_s") for arm in ("base", "new")},
        "base/new": paired("base", "new"),
        "daemon_cpu_s": {
            arm: statistics.median(r["daemon_cpu_s"] for r in runs[arm]) for arm in ("base", "new")
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base-src", required=True, help="the other checkout's src directory")
    parser.add_argument("--mounts", default="cross-region")
    parser.add_argument("--layouts", default="packed,per-expert")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--data", type=Path, default=Path("/var/tmp/spanwarm-bench"))
    args = parser.parse_args()
    rng = random.Random(1)
    results = {}
    for layout in args.layouts.split(","):
        source = args.data / f"moe-{layout}"
        e2e.build_checkpoint(source, layout)
        for preset in args.mounts.split(","):
            results[f"{layout}/{preset}"] = compare(source, preset, args.base_src, args.reps, rng)
            print(layout, preset, json.dumps(results[f"{layout}/{preset}"]), flush=True)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
