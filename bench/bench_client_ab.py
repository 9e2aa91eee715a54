"""Paired A/B of two client builds on one daemon: none / spanwarm (base) / spanwarm (new).

    git worktree add /tmp/base <commit>
    .venv/bin/python bench/bench_client_ab.py --base-src /tmp/base/src [--load tf|per-expert|packed]
        [--resident] [--reps 7] [--data /var/tmp/spanwarm-bench]

One daemon (this tree's) on the ``local`` mount; per repetition the three arms run in a
shuffled order on a freshly evicted page cache, the base arm's ranks with ``PYTHONPATH``
at the other tree's ``src`` (the editable install is a plain ``.pth``, so that wins).
``tf``: transformers' ``from_pretrained`` (bench_transformers_load.py's model and ranks);
``per-expert``/``packed``: bench_end_to_end.py's load. ``--resident``: every run finds
the checkpoint in the page cache (the "already resident" case). Prints each run's wall time and
bytes read from storage, then medians and paired ratios.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:  # run as a script: bench/ is on the path, not its parent
    sys.path.insert(0, str(HERE.parent))

from bench import bench_end_to_end as e2e  # noqa: E402
from bench import bench_transformers_load as tf  # noqa: E402
from spanwarm.testing.spawn import spawn_daemon  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base-src", required=True, help="the other checkout's src directory")
    parser.add_argument("--load", default="tf", choices=("tf", "per-expert", "packed"))
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--data", type=Path, default=Path("/var/tmp/spanwarm-bench"))
    parser.add_argument(
        "--resident",
        action="store_true",
        help="load with the checkpoint in the page cache (read whole before each run)",
    )
    args = parser.parse_args()
    extra: tuple[str, ...] = ()
    if args.load == "tf":
        source = args.data / "tf-qwen3moe-per-expert"
        tf.build_model(source)
        script, world, extra, stderr = "tf_load_rank.py", tf.WORLD, (), subprocess.DEVNULL
    else:
        source = args.data / f"moe-{args.load}"
        e2e.build_checkpoint(source, args.load)
        script, world, extra = "e2e_rank.py", e2e.WORLD, ("--experts", str(e2e.EXPERTS))
        stderr = None
    # Per run: wall, MiB read from storage, the ranks' CPU (all threads, summed) and the
    # slowest rank's request() (spanwarm arms; e2e loads only).
    rows: dict[str, list[tuple[float, float, float, float]]] = {"none": [], "base": [], "new": []}
    flags = ("--log-level", "warning", "--state-dir", str(args.data / "state"))
    with e2e.mounted(source, "local") as (checkpoint, fs), spawn_daemon(*flags) as daemon:
        paths = sorted(checkpoint.glob("*.safetensors"))

        def run(arm: str) -> dict[str, Any]:
            for path in paths if args.resident else ():
                path.read_bytes()  # what idle reclaim took back since the last run
            result: dict[str, Any] = e2e.run_local_ranks(
                script,
                "none" if arm == "none" else "spanwarm",
                checkpoint,
                paths,
                daemon.socket,
                fs,
                world=world,
                local_world=2,
                extra=extra,
                stderr=stderr,
                cold=not args.resident,
            )
            return result

        run("new")  # the mount's first load: the daemon learns it (not measured)
        rng = random.Random(0)
        for rep in range(args.reps):
            for arm in rng.sample(sorted(rows), len(rows)):
                saved = os.environ.get("PYTHONPATH")
                if arm == "base":
                    os.environ["PYTHONPATH"] = args.base_src
                try:
                    result = run(arm)
                finally:
                    os.environ.pop("PYTHONPATH", None)
                    if saved is not None:
                        os.environ["PYTHONPATH"] = saved
                mib = result["storage_bytes"] / 2**20
                ranks = result["results"]
                cpu = sum(r.get("cpu_s", 0.0) for r in ranks)
                request = max(r.get("request_s") or 0.0 for r in ranks)
                rows[arm].append((result["wall_s"], mib, cpu, request))
                print(
                    f"rep {rep} {arm}: {result['wall_s']:.3f} s, {mib:.0f} MiB, ranks' CPU "
                    f"{cpu:.3f} s, request() {1e3 * request:.1f} ms",
                    flush=True,
                )
    for arm, rs in rows.items():
        wall, mib, cpu, request = (statistics.median(r[i] for r in rs) for i in range(4))
        print(
            f"{arm}: wall {wall:.3f} s (fastest {min(r[0] for r in rs):.3f} s), read from "
            f"storage {mib:.0f} MiB, ranks' CPU {cpu:.3f} s, request() {1e3 * request:.1f} ms"
            " (medians)"
        )
    for a, b in (("none", "new"), ("none", "base"), ("base", "new")):
        pairs = list(zip(rows[a], rows[b], strict=True))
        wall = statistics.median(x[0] / y[0] for x, y in pairs)
        cpus = [x[2] / y[2] for x, y in pairs if y[2] > 0]  # tf ranks do not report it
        cpu = f", ranks' CPU {statistics.median(cpus):.3f}" if cpus else ""
        print(f"paired {a}/{b}: wall {wall:.3f}{cpu}")


if __name__ == "__main__":
    main()
