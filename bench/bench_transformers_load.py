"""transformers' own ``from_pretrained`` of a per-expert MoE checkpoint, node 0 of a job.

    .venv/bin/python bench/bench_transformers_load.py [--mounts local,cross-region] [--reps 3]
        [--daemon-args "--state-dir DIR"]

A Qwen3-MoE model (6 layers, 32 experts, hidden 1024: 0.8 GB of random bf16 bytes,
written once under --data) saved the way ``save_pretrained`` saves it, one tensor per
expert. The job is 8 nodes x 2 ranks with ``DistributedConfig(fsdp_size=16, ep_size=4)``;
node 0's two ranks run here as processes, each a real ``from_pretrained`` with torch's
fake process group standing in for the other 14 ranks. Arms, on a freshly evicted page
cache, interleaved per repetition:

- (a) ``none``: transformers alone;
- (b) ``whole``: the seed's base PR, ``files[local_rank::local_world]`` read whole first;
- (c) ``spanwarm``: ``spanwarm.integrations.transformers`` enabled, a daemon on the node;
- (d) ``limit``: what the storage allows for exactly the bytes spanwarm reads: the node
  plan's runs (the two ranks' spans from transformers on meta, ``spanwarm plan``'s
  what-if, through the cost model) read by the best raw reader of the mount
  (``bench_end_to_end.read_runs``: 8 streams, 8 MiB operations, no daemon, no loader).

Reported per arm: wall time from both ranks starting (after imports) until both have
loaded, bytes read from storage (the emulated mount's counter; on ``local`` the block
device's), and under (c) the time the loader spent waiting for readiness.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:  # run as a script: bench/ is on the path, its parent is not
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.bench_end_to_end import (  # noqa: E402
    mounted,
    probed_seek_cost,
    run_limit,
    run_local_ranks,
)
from spanwarm.checkpoint.resolve import open_checkpoint  # noqa: E402
from spanwarm.checkpoint.samples import write_sharded_checkpoint  # noqa: E402
from spanwarm.planning.planner import plan_node_spans  # noqa: E402
from spanwarm.testing.spawn import spawn_daemon  # noqa: E402
from spanwarm.units import format_bytes  # noqa: E402

WORLD, LOCAL_WORLD, EP = 16, 2, 4  # DistributedConfig(fsdp_size=WORLD, ep_size=EP)
ARMS = ("none", "whole", "spanwarm", "limit")


def build_model(directory: Path) -> list[Path]:
    """Write (once) the per-expert checkpoint with random bytes; reuse it when it is there."""
    marker = directory / "complete"
    if marker.exists():
        return sorted(directory.glob("*.safetensors"))
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.utils import logging as tf_logging

    tf_logging.set_verbosity(logging.ERROR)
    shutil.rmtree(directory, ignore_errors=True)
    config = Qwen3MoeConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2048,
        moe_intermediate_size=512,
        num_experts=32,
        num_experts_per_tok=4,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)  # type: ignore[no-untyped-call]
    state = revert_weight_conversion(model, model.state_dict())
    rng = np.random.default_rng(0)
    tensors: dict[str, Any] = {
        name: (
            "BF16",
            tuple(value.shape),
            rng.integers(0, 256, value.numel() * 2, dtype=np.uint8).tobytes(),
        )
        for name, value in state.items()
    }
    paths = write_sharded_checkpoint(directory, tensors, shard_bytes=100 * 10**6)
    config.architectures = [type(model).__name__]
    config.save_pretrained(directory)
    for path in paths:
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    marker.touch()
    return paths


def node_runs(model: Path, seek_cost: int) -> list[tuple[str, int, int]]:
    """The node plan's runs for node 0's ranks, as transformers would have them read."""
    from spanwarm.integrations.transformers.whatif import rank_load_spans

    checkpoint = open_checkpoint(model)
    sizes = {"fsdp_size": WORLD, "ep_size": EP}
    spans = rank_load_spans(model, checkpoint, sizes, world=WORLD, ranks=range(LOCAL_WORLD))
    plan = plan_node_spans(
        checkpoint,
        (s for rank in spans.values() for s in rank),
        node=0,
        ranks=list(range(LOCAL_WORLD)),
        seek_cost=seek_cost,
    )
    return [(f.path, a, b) for f in plan.files for a, b in f.runs.pairs()]


def run_arm(arm: str, model: Path, paths: list[Path], socket: str, fs: Any) -> dict[str, Any]:
    run = run_local_ranks(
        "tf_load_rank.py",
        arm,
        model,
        paths,
        socket,
        fs,
        world=WORLD,
        local_world=LOCAL_WORLD,
        stderr=subprocess.DEVNULL,  # transformers' progress bars
    )
    results = run.pop("results")
    return {
        **run,
        "waited_s": [r["waited_s"] for r in results],
        "requested_bytes": sum(r["requested_bytes"] for r in results),
    }


def summarize(label: str, runs: list[dict[str, Any]], total: int) -> list[str]:
    lines = [
        f"\n### {label}\n",
        "| arm | wall (median, min-max) | read from storage | peak page cache "
        "| loader waited, rank 0 / 1 |",
        "| --- | --- | --- | --- | --- |",
    ]
    by_arm = {arm: [r for r in runs if r["arm"] == arm] for arm in ARMS}
    for arm, rs in by_arm.items():
        walls = [r["wall_s"] for r in rs]
        waited = " / ".join(
            f"{statistics.median(r['waited_s'][i] for r in rs):.2f} s" for i in range(LOCAL_WORLD)
        )
        lines.append(
            f"| {arm} | {statistics.median(walls):.2f} s ({min(walls):.2f}-{max(walls):.2f}) "
            f"| {format_bytes(int(statistics.median(r['storage_bytes'] for r in rs)))} "
            f"| {format_bytes(int(statistics.median(r['peak_cache_bytes'] for r in rs)))} "
            f"| {waited if arm == 'spanwarm' else ''} |"
        )
    reps = len(by_arm["spanwarm"])
    ratio = {
        arm: statistics.median(
            by_arm[arm][i]["wall_s"] / by_arm["spanwarm"][i]["wall_s"] for i in range(reps)
        )
        for arm in ("none", "whole", "limit")
    }
    planned = statistics.median(r["planned_bytes"] for r in by_arm["spanwarm"])
    lines.append(
        f"\nPaired ratios (same repetition), median: (a)/(c) = {ratio['none']:.2f}x, "
        f"(b)/(c) = {ratio['whole']:.2f}x, (c)/(d) = {1 / ratio['limit']:.2f}x. The node "
        f"plan held {format_bytes(int(planned))} of the {format_bytes(total)} checkpoint."
    )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mounts", default="local,cross-region")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--data", type=Path, default=Path("/var/tmp/spanwarm-bench"))
    parser.add_argument("--markdown", type=Path)
    parser.add_argument(
        "--daemon-args",
        default="",
        help="extra `spanwarm serve` flags, e.g. '--state-dir DIR' (a node that has probed "
        "its mounts before) or '--seek-cost 12MiB'",
    )
    args = parser.parse_args()
    daemon_args = args.daemon_args.split()
    command = "python bench/bench_transformers_load.py " + " ".join(sys.argv[1:])
    lines = [
        "\n## transformers from_pretrained, per-expert MoE, node 0 of 8 x 2\n",
        f"```console\n{command}\n```",
    ]
    source = args.data / "tf-qwen3moe-per-expert"
    paths = build_model(source)
    total = sum(p.stat().st_size for p in paths)
    print(f"{len(paths)} shards, {format_bytes(total)}", flush=True)
    rng = random.Random(0)
    for preset in args.mounts.split(","):
        with (
            mounted(source, preset) as (model, fs),
            spawn_daemon("--log-level", "warning", *daemon_args) as daemon,
        ):
            mounted_paths = sorted(model.glob("*.safetensors"))
            # The node's first load on the mount, not measured: the daemon learns the mount
            # from it and probes its seek cost once idle (not during a measured arm).
            run_arm("spanwarm", model, mounted_paths, daemon.socket, fs)
            seek_cost = probed_seek_cost(daemon.socket, mounted_paths[0], daemon_args)
            limit_runs = node_runs(model, seek_cost)
            runs = []
            for rep in range(args.reps):
                for arm in rng.sample(ARMS, len(ARMS)):
                    if arm == "limit":
                        run = {
                            **run_limit(limit_runs, mounted_paths, fs),
                            "waited_s": [0.0] * LOCAL_WORLD,
                            "requested_bytes": 0,
                        }
                    else:
                        run = run_arm(arm, model, mounted_paths, daemon.socket, fs)
                    print(f"{preset} rep {rep} {arm}: {run['wall_s']:.2f} s", flush=True)
                    runs.append(run)
            lines += summarize(
                f"{preset}: {format_bytes(total)} in {len(paths)} shards", runs, total
            )
    text = "\n".join(lines) + "\n"
    if args.markdown:
        args.markdown.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
