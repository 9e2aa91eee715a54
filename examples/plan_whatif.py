"""What-if: which bytes each node warms for a sharded MoE checkpoint.

Writes a synthetic MoE + dense checkpoint (sparse files: several GiB that cost no disk),
then asks the planner what node 0 warms when 8 ranks load it on 1, 2 and 4 nodes with
expert parallelism and tensor parallelism, next to the whole-shard prefetch the seed's
base PR does. No torch, no daemon: the what-if planner of ``spanwarm plan``.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from spanwarm.checkpoint.resolve import open_checkpoint
from spanwarm.checkpoint.samples import SparseTensor, write_sharded_checkpoint
from spanwarm.cli.plan import render
from spanwarm.planning.planner import PlacementRule, plan_node
from spanwarm.units import format_bytes

LAYERS, HIDDEN, EXPERTS, INTERMEDIATE, VOCAB = 8, 2048, 32, 768, 32000
WORLD = 8
RULES = [
    r"experts\.(gate_up|down)_proj=Shard(0)",  # expert parallel: each rank owns 4 experts
    r"self_attn\.(q|k|v)_proj=Shard(0)",  # column-parallel TP
    r"self_attn\.o_proj=Shard(1)",  # row-parallel TP: strided spans
    r"(embed_tokens|lm_head)=Shard(0)",  # vocab-parallel
]


def moe_checkpoint(directory: Path) -> None:
    tensors: dict[str, SparseTensor] = {
        "model.embed_tokens.weight": SparseTensor("BF16", (VOCAB, HIDDEN))
    }
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            tensors[f"{p}.self_attn.{proj}.weight"] = SparseTensor("BF16", (HIDDEN, HIDDEN))
        tensors[f"{p}.mlp.experts.gate_up_proj"] = SparseTensor(
            "BF16", (EXPERTS, 2 * INTERMEDIATE, HIDDEN)
        )
        tensors[f"{p}.mlp.experts.down_proj"] = SparseTensor(
            "BF16", (EXPERTS, HIDDEN, INTERMEDIATE)
        )
        tensors[f"{p}.mlp.gate.weight"] = SparseTensor("BF16", (EXPERTS, HIDDEN))
        tensors[f"{p}.input_layernorm.weight"] = SparseTensor("BF16", (HIDDEN,))
    tensors["model.norm.weight"] = SparseTensor("BF16", (HIDDEN,))
    tensors["lm_head.weight"] = SparseTensor("BF16", (VOCAB, HIDDEN))
    write_sharded_checkpoint(directory, tensors, shard_bytes=1 << 30)


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="spanwarm-demo-") as tmp:
        directory = Path(tmp) / "moe"
        moe_checkpoint(directory)
        checkpoint = open_checkpoint(directory)
        total = sum(h.file_size for h in checkpoint.headers)
        print(f"checkpoint: {len(checkpoint.headers)} shards, {format_bytes(total)}, {WORLD} ranks")
        print("placements:\n  " + "\n  ".join(RULES) + "\n")
        rules = [PlacementRule.parse(r) for r in RULES]
        for nodes in (1, 2, 4):
            local_world = WORLD // nodes
            plan = plan_node(checkpoint, world=WORLD, local_world=local_world, node=0, rules=rules)
            print(f"--- {nodes} node(s) x {local_world} ranks ---")
            print(render(plan))
            print(
                f"node 0 warms {format_bytes(plan.warm_bytes)} of {format_bytes(total)}; "
                f"whole-shard prefetch warms all {format_bytes(total)} on every node\n"
            )
        print(
            "Try it on your own checkpoint:\n"
            "  spanwarm plan CHECKPOINT --world 8 --local-world 4 --place 'experts=Shard(0)'"
        )


if __name__ == "__main__":
    main()
