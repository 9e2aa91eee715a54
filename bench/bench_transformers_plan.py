"""What each node warms for real-size MoE models loaded by transformers' distributed loader.

    .venv/bin/python bench/bench_transformers_plan.py [--repeat 3]

Sparse checkpoints (holes: no disk, no time) with the key names and shapes transformers
itself saves: Mixtral-8x7B (46.7B parameters, 8 experts) and Qwen3-MoE with
transformers' default config (15.4B, 128 experts), each per expert (``save_pretrained``'s
default, obtained from transformers' ``revert_weight_conversion``) and packed. For every
node of a 4-node job, the bytes its ranks read (from
``spanwarm.integrations.transformers.whatif``, the code behind ``spanwarm plan
MODEL_DIR``), how many of them are expert bytes, and what the seed's in-library prefetch
read: it could not see through conversions, so on a per-expert checkpoint every node read
every expert tensor whole. Also the wall time of the ``spanwarm plan`` command itself
(process start, transformers import and the meta model included; median of --repeat).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from spanwarm.checkpoint.resolve import Checkpoint, open_checkpoint
from spanwarm.checkpoint.samples import SparseTensor, write_sharded_checkpoint
from spanwarm.checkpoint.spans import SpanTable
from spanwarm.checkpoint.tensor_layout import TensorSpans
from spanwarm.integrations.transformers.whatif import rank_load_spans

EXPERT = re.compile(r"\.experts\.\d+\.|\.experts\.(gate_up|down)_proj")
GiB = 2**30
DTYPES = {"torch.bfloat16": "BF16", "torch.float32": "F32"}
SETUPS: list[tuple[str, dict[str, int], int]] = [
    ("FSDP32 x EP8", {"fsdp_size": 32, "ep_size": 8}, 8),
    ("TP8 x FSDP4", {"tp_size": 8, "fsdp_size": 4}, 8),
]


def write_model(config: Any, directory: Path, *, per_expert: bool) -> None:
    """A sparse checkpoint of ``config``'s model as transformers would save it."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)  # type: ignore[no-untyped-call]
    state = model.state_dict()
    if per_expert:
        state = revert_weight_conversion(model, state)
    tensors = {k: SparseTensor(DTYPES[str(v.dtype)], tuple(v.shape)) for k, v in state.items()}
    write_sharded_checkpoint(directory, tensors, shard_bytes=5 * 10**9)
    config.save_pretrained(directory)


def covered(spans: list[TensorSpans]) -> int:
    by_file: dict[str, list[Any]] = {}
    for s in spans:
        by_file.setdefault(s.path, []).append(s.span)
    return sum(SpanTable.of(rows).covered_bytes() for rows in by_file.values())


def tensor_bytes(checkpoint: Checkpoint, names: set[str]) -> int:
    return sum(info.nbytes for n in names for _, info in checkpoint.pieces[n])


def plan_seconds(directory: Path, sizes: dict[str, int], local_world: int, repeat: int) -> float:
    flags = [f"--{k.removesuffix('_size').replace('_', '-')}={v}" for k, v in sizes.items()]
    times = []
    for _ in range(repeat):
        start = time.monotonic()
        subprocess.run(
            [
                sys.executable,
                "-m",
                "spanwarm",
                "plan",
                str(directory),
                *flags,
                "--local-world",
                str(local_world),
                "--json",
            ],
            check=True,
            capture_output=True,
        )
        times.append(time.monotonic() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    from transformers import MixtralConfig, Qwen3MoeConfig
    from transformers.utils import logging as tf_logging

    tf_logging.set_verbosity(logging.ERROR)
    models = {"Mixtral-8x7B": MixtralConfig(), "Qwen3-MoE (default config)": Qwen3MoeConfig()}
    print(
        "| model | layout | parallelism, 4 nodes x 8 ranks | each node reads (GiB, node 0/1/2/3) "
        "| of which experts | the seed read, per node | checkpoint | `spanwarm plan` |"
    )
    print("| --- | --- | --- | --- | --- | --- | ---: | ---: |")
    with tempfile.TemporaryDirectory(prefix="sw-tf-") as tmp:
        for model, config in models.items():
            for layout in ("per expert", "packed"):
                directory = Path(tmp) / f"{model}-{layout}".replace(" ", "_")
                write_model(config, directory, per_expert=layout == "per expert")
                checkpoint = open_checkpoint(directory)
                experts = {n for n in checkpoint.pieces if EXPERT.search(n)}
                total = sum(h.file_size for h in checkpoint.headers)
                for label, sizes, local_world in SETUPS:
                    world = sizes.get("tp_size", 1) * sizes.get("fsdp_size", 1)
                    spans = rank_load_spans(
                        directory, checkpoint, sizes, world=world, ranks=range(world)
                    )
                    reads, expert_reads, seed = [], [], []
                    for node in range(world // local_world):
                        ranks = range(node * local_world, (node + 1) * local_world)
                        node_spans = [s for r in ranks for s in spans[r]]
                        reads.append(covered(node_spans))
                        expert_reads.append(covered([s for s in node_spans if s.tensor in experts]))
                        seed.append(
                            reads[-1] - expert_reads[-1] + tensor_bytes(checkpoint, experts)
                            if layout == "per expert"
                            else reads[-1]
                        )
                    seconds = plan_seconds(directory, sizes, local_world, args.repeat)
                    print(
                        f"| {model} | {layout} | {label} | {gib(reads)} | {gib(expert_reads)} "
                        f"| {gib(seed)} | {total / GiB:.2f} GiB | {seconds:.1f} s |",
                        flush=True,
                    )


def gib(values: list[int]) -> str:
    return " / ".join(f"{v / GiB:.2f}" for v in values)


if __name__ == "__main__":
    main()
