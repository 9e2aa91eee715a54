"""Resuming training from a torch Distributed Checkpoint in another layout, node 0 of the job.

    .venv/bin/python bench/bench_dcp_resume.py [--mounts local,cross-region] [--reps 3] \
        [--json PATH]

A training job's checkpoint in DCP's native format (bench/dcp_resume_rank.py: a 3-layer
transformer's bf16 parameters, Adam's f32 ``exp_avg`` and ``exp_avg_sq`` and scalar
``step`` per parameter, the global step; 1.2 GB, written once under --data), saved by 4
gloo ranks under torchrun with an FSDP-like layout (every tensor ``Shard(0)`` on a mesh of
4): one ``.distcp`` per saving rank plus ``.metadata``. The job resumes with 2 ranks (this
machine has 2 cores), here as processes with gloo, in a TP-like layout on a mesh of 2
(column-parallel and embedding weights ``Shard(0)``, row-parallel ``Shard(1)``, norms
replicated): ``dcp.load(state, checkpoint_id=...)`` from the mounted checkpoint, each
stored chunk a rank needs read whole (``torch.load``) and narrowed. Arms, one after
another on a freshly evicted page cache, interleaved per repetition in a random order:

- ``none``: DCP alone;
- ``spanwarm``: ``spanwarm.integrations.dcp.enable`` on a daemon (one per mount): each
  rank requests exactly what its reader will read, once its load plan is final.

Ranks set up (process group, the state dict to load into) before a barrier, then time
their ``dcp.load``. Reported per arm: wall time from the barrier until both ranks have
loaded, bytes read from storage (the emulated mount's counter; on ``local`` the block
device's read counter, which anything else reading meanwhile adds to), peak page cache
used by the checkpoint, and under ``spanwarm`` the time the reads waited for readiness
(summed over both ranks), plus the paired median ratio of wall times none/spanwarm. Every
rank checks every value it loaded against the saved ones and fails the run if one differs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:  # run as a script: bench/ is on the path, its parent is not
    sys.path.insert(0, str(ROOT))

from bench.bench_end_to_end import (  # noqa: E402
    mounted,
    probed_seek_cost,
    run_local_ranks,
    settle,
)
from spanwarm.testing.spawn import spawn_daemon  # noqa: E402
from spanwarm.units import format_bytes  # noqa: E402

SAVE_WORLD, WORLD, LOCAL_WORLD = 4, 2, 2  # the saving job; the resuming job, node 0's
ARMS = ("none", "spanwarm")


def checkpoint_files(directory: Path) -> list[Path]:
    return [*sorted(directory.glob("*.distcp")), directory / ".metadata"]


def build_checkpoint(directory: Path) -> list[Path]:
    """Save (once) the training state with 4 ranks under torchrun; reuse it when it is there."""
    marker = directory / "complete"
    if marker.exists():
        return checkpoint_files(directory)
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(SAVE_WORLD),
            str(HERE / "dcp_resume_rank.py"),
            "save",
            str(directory),
        ],
        check=True,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    paths = checkpoint_files(directory)
    settle(paths)
    marker.touch()
    return paths


def run_arm(arm: str, checkpoint: Path, paths: list[Path], socket: str, fs: Any) -> dict[str, Any]:
    run = run_local_ranks(
        "dcp_resume_rank.py",
        arm,
        checkpoint,
        paths,
        socket,
        fs,
        world=WORLD,
        local_world=LOCAL_WORLD,
    )
    results = run.pop("results")
    return {
        **run,
        "load_s": [r["total_s"] for r in results],
        "waited_s": sum(r.get("waited_s", 0.0) for r in results),
        "requested_bytes": sum(r.get("requested_bytes", 0) for r in results),
        "items": sum(r.get("items", 0) for r in results),
        "warm": sum(r.get("warm", 0) for r in results),
    }


def summarize(label: str, runs: list[dict[str, Any]]) -> tuple[list[str], dict[str, Any]]:
    """The markdown table for one mount, and its numbers for --json."""
    by_arm = {arm: [r for r in runs if r["arm"] == arm] for arm in ARMS}
    medians: dict[str, Any] = {}
    lines = [
        f"\n### {label}\n",
        "| arm | wall (median, min-max) | slowest rank's dcp.load | read from storage "
        "| peak page cache | reads waited (both ranks) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for arm, rs in by_arm.items():
        walls = [r["wall_s"] for r in rs]
        medians[arm] = {
            key: statistics.median(r[key] for r in rs)
            for key in ("wall_s", "storage_bytes", "peak_cache_bytes", "waited_s")
        }
        medians[arm]["slowest_load_s"] = statistics.median(max(r["load_s"]) for r in rs)
        medians[arm]["walls_s"] = walls
        waited = f"{medians[arm]['waited_s']:.2f} s" if arm == "spanwarm" else ""
        lines.append(
            f"| {arm} | {medians[arm]['wall_s']:.2f} s ({min(walls):.2f}-{max(walls):.2f}) "
            f"| {medians[arm]['slowest_load_s']:.2f} s "
            f"| {format_bytes(int(medians[arm]['storage_bytes']))} "
            f"| {format_bytes(int(medians[arm]['peak_cache_bytes']))} | {waited} |"
        )
    spanwarm = by_arm["spanwarm"]
    ratios = [n["wall_s"] / s["wall_s"] for n, s in zip(by_arm["none"], spanwarm, strict=True)]
    ratio = statistics.median(ratios)
    requested = statistics.median(r["requested_bytes"] for r in spanwarm)
    planned = statistics.median(r["planned_bytes"] for r in spanwarm)
    warm = min(r["warm"] / r["items"] for r in spanwarm)
    lines += [
        f"\nPaired ratio (same repetition), median: none/spanwarm = {ratio:.2f}x "
        f"(per repetition: {', '.join(f'{x:.2f}x' for x in ratios)}).",
        f"spanwarm: the ranks requested {format_bytes(int(requested))} (summed over both "
        f"ranks, which need some of the same chunks), a node plan of "
        f"{format_bytes(int(planned))}; in the least warm run the daemon reported {warm:.0%} "
        "of the requested items warm.",
    ]
    summary = {
        "arms": medians,
        "paired_ratio_none_over_spanwarm": ratio,
        "paired_ratios": ratios,
        "requested_bytes": requested,
        "planned_bytes": planned,
    }
    return lines, summary


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mounts", default="local,cross-region")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--data", type=Path, default=Path("/var/tmp/spanwarm-bench"))
    parser.add_argument("--json", type=Path, help="write the medians and paired ratios here")
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # 2 ranks on 2 cores
    began = time.monotonic()
    command = "python bench/bench_dcp_resume.py " + " ".join(sys.argv[1:])
    lines = [
        "\n## torch DCP: resuming from an FSDP4 checkpoint as TP2, node 0\n",
        f"```console\n{command}\n```",
    ]
    source = args.data / "dcp-resume-fsdp4"
    paths = build_checkpoint(source)
    total = sum(p.stat().st_size for p in paths)
    print(f"{len(paths)} files, {format_bytes(total)}", flush=True)
    report: dict[str, Any] = {"checkpoint_bytes": total, "files": len(paths), "mounts": {}}
    rng = random.Random(0)
    for preset in args.mounts.split(","):
        with (
            mounted(source, preset) as (checkpoint, fs),
            spawn_daemon("--log-level", "warning") as daemon,
        ):
            mounted_paths = checkpoint_files(checkpoint)
            # The node's first load on the mount, not measured: the daemon learns the mount
            # from it and probes its seek cost once idle (not during a measured arm).
            run_arm("spanwarm", checkpoint, mounted_paths, daemon.socket, fs)
            probed_seek_cost(daemon.socket, mounted_paths[0], [])
            runs = []
            for rep in range(args.reps):
                for arm in rng.sample(ARMS, len(ARMS)):
                    run = run_arm(arm, checkpoint, mounted_paths, daemon.socket, fs)
                    runs.append(run)
                    print(
                        f"  {preset} rep {rep} {arm}: {run['wall_s']:.2f} s, "
                        f"read {format_bytes(run['storage_bytes'])}, ranks' loads "
                        + " / ".join(f"{s:.2f} s" for s in run["load_s"])
                        + (f", waited {run['waited_s']:.2f} s" if arm == "spanwarm" else ""),
                        flush=True,
                    )
        label = f"{format_bytes(total)} in {len(paths)} files, mount `{preset}`"
        table, summary = summarize(label, runs)
        lines += table
        report["mounts"][preset] = summary
    report["elapsed_s"] = time.monotonic() - began
    text = "\n".join(lines) + "\n"
    print(text)
    if args.markdown:
        args.markdown.write_text(text)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
