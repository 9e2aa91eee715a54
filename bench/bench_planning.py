"""Planning speed: rank_spans for a 1,000-tensor state dict on a 2-D mesh (headers
cached), and the node plan for 64 ranks x 2,000 tensors.

    .venv/bin/python bench/bench_planning.py [--repeat 15]

Prints medians and min-max of repeated runs (these machines are noisy; no single run
means much). Checkpoints are sparse files in a temporary directory.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from spanwarm.checkpoint import placements, tensor_layout
from spanwarm.checkpoint.resolve import open_checkpoint
from spanwarm.checkpoint.samples import SparseTensor, write_sharded_checkpoint
from spanwarm.planning.planner import PlacementRule, plan_node

HIDDEN, INTERMEDIATE = 4096, 11008


def dense_model(tensors: int) -> dict[str, SparseTensor]:
    """A Llama-like dense model cut to ``tensors`` 2-D weights (7 per layer)."""
    shapes = {
        "self_attn.q_proj": (HIDDEN, HIDDEN),
        "self_attn.k_proj": (HIDDEN // 4, HIDDEN),
        "self_attn.v_proj": (HIDDEN // 4, HIDDEN),
        "self_attn.o_proj": (HIDDEN, HIDDEN),
        "mlp.gate_proj": (INTERMEDIATE, HIDDEN),
        "mlp.up_proj": (INTERMEDIATE, HIDDEN),
        "mlp.down_proj": (HIDDEN, INTERMEDIATE),
    }
    out: dict[str, SparseTensor] = {}
    layer = 0
    while len(out) < tensors:
        for suffix, shape in shapes.items():
            if len(out) < tensors:
                out[f"model.layers.{layer}.{suffix}.weight"] = SparseTensor("BF16", shape)
        layer += 1
    return out


COLWISE = r"(q|k|v|gate|up)_proj"
ROWWISE = r"(o|down)_proj"


def clear_layout_caches() -> None:
    """Forget memoised index runs and spans: each timed run starts as a fresh load would."""
    for cached in (
        placements._dim_runs,
        placements._local_index_runs,
        tensor_layout._piece_spans,
        tensor_layout._relative_spans,
    ):
        cached.cache_clear()


def timed(fn: Callable[[], object], repeat: int) -> list[float]:
    fn()  # warm up imports and the header cache
    times = []
    for _ in range(repeat):
        clear_layout_caches()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def report(label: str, times: list[float]) -> None:
    ms = [t * 1000 for t in times]
    print(
        f"| {label} | {statistics.median(ms):.1f} ms | {min(ms):.1f}-{max(ms):.1f} ms | {len(ms)} |"
    )


def bench_rank_spans(directory: Path, repeat: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from spanwarm.client import rank_spans

    tensors = dense_model(1000)
    write_sharded_checkpoint(directory, tensors, shard_bytes=5 << 30)
    dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=8)
    mesh = init_device_mesh("cpu", (2, 4))  # FSDP x TP
    state = {}
    for name, t in tensors.items():
        tp = (
            Shard(0)
            if any(p in name for p in ("q_proj", "k_proj", "v_proj", "gate", "up_proj"))
            else Shard(1)
        )
        meta = torch.empty(t.shape, dtype=torch.bfloat16, device="meta")
        state[name] = distribute_tensor(meta, mesh, [Shard(0), tp], src_data_rank=None)
    spans = rank_spans(state, directory)
    report(
        f"rank_spans: 1,000 tensors, mesh 2x4, {len(spans)} spans",
        timed(lambda: rank_spans(state, directory), repeat),
    )
    dist.destroy_process_group()


def bench_plan(directory: Path, repeat: int) -> None:
    write_sharded_checkpoint(directory, dense_model(2000), shard_bytes=5 << 30)
    checkpoint = open_checkpoint(directory)
    rules = [
        PlacementRule.parse(f"{COLWISE}=[Shard(0),Shard(0)]"),
        PlacementRule.parse(f"{ROWWISE}=[Shard(0),Shard(1)]"),
    ]
    for local_world in (8, 64):
        report(
            f"plan_node: 64 ranks (8x8 mesh), {local_world} per node, 2,000 tensors",
            timed(
                partial(
                    plan_node,
                    checkpoint,
                    world=64,
                    local_world=local_world,
                    mesh_shape=(8, 8),
                    rules=rules,
                ),
                repeat,
            ),
        )
    for local_world in (8, 64):
        command = [
            sys.executable,
            "-m",
            "spanwarm",
            "plan",
            str(directory),
            "--world",
            "64",
            "--local-world",
            str(local_world),
            "--mesh",
            "8x8",
            "--place",
            f"{COLWISE}=[Shard(0),Shard(0)]",
            "--place",
            f"{ROWWISE}=[Shard(0),Shard(1)]",
            "--json",
        ]
        report(
            f"`spanwarm plan` command, 64 ranks, {local_world} per node (process start included)",
            timed(
                partial(subprocess.run, command, check=True, capture_output=True),
                max(3, repeat // 3),
            ),
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeat", type=int, default=15)
    args = parser.parse_args()
    print("| what | median | min-max | runs |\n| --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        bench_rank_spans(Path(tmp) / "rank_spans", args.repeat)
        bench_plan(Path(tmp) / "plan", args.repeat)


if __name__ == "__main__":
    main()
