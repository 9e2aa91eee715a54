"""``spanwarm plan``: which bytes node N warms, with no torch and no daemon."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import warnings
from collections.abc import Iterator
from typing import Any

from spanwarm.checkpoint.resolve import Checkpoint, open_checkpoint
from spanwarm.cli.arguments import size
from spanwarm.errors import CheckpointError
from spanwarm.planning.costmodel import DEFAULT_SEEK_COST
from spanwarm.planning.planner import (
    NodePlan,
    PlacementRule,
    check_layout,
    plan_node,
    plan_node_spans,
)
from spanwarm.units import format_bytes

EXAMPLES = """\
examples:
  spanwarm plan ./ckpt --world 8 --local-world 4 --place 'experts=Shard(0)'
  spanwarm plan ./ckpt --world 16 --local-world 8 --mesh 4x4 --node 1 \\
      --place 'gate_up_proj=[_StridedShard(0,sf=4),Shard(0)]' \\
      --place 'down_proj=[Replicate(),Shard(1)]'
  # a transformers model directory: placements come from transformers itself
  spanwarm plan ./Mixtral-8x7B --fsdp 16 --ep 4 --local-world 4 --node 2
  # a vLLM deployment (vLLM installed; no GPU): TP4 x PP2 over two nodes of 4
  spanwarm plan ./Qwen3-30B-A3B --vllm --tp 4 --pp 2 --ep 4 --local-world 4 --node 1
"""


def _mesh(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(d) for d in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"mesh {text!r} is not like 4 or 2x4") from None
    if not dims or any(d < 1 for d in dims):
        raise argparse.ArgumentTypeError(f"mesh {text!r} has a dim below 1")
    return dims


def _rule(text: str) -> PlacementRule:
    try:
        return PlacementRule.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_parser(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        "plan",
        help="what-if: which bytes one node warms for a checkpoint and placements",
        description=(
            "Which bytes node N warms if CHECKPOINT is loaded by W ranks, L per node. Ranks map "
            "to mesh coordinates in row-major order; node N holds ranks N*L .. N*L+L-1. A tensor "
            "takes the placements of the first --place whose regex it matches (re.search) and is "
            "replicated otherwise. With --tp/--fsdp/--ep/--dp-replicate, CHECKPOINT is a "
            "transformers model directory and every rank's placements and weight conversions "
            "come from transformers (on meta, with torch's fake process group); W is then the "
            "product of the sizes."
        ),
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("checkpoint", help="directory (index.json or *.safetensors), or one file")
    parser.add_argument("--world", type=int, metavar="W", help="ranks in the job")
    parser.add_argument(
        "--nodes", type=int, metavar="K", help="nodes in the job (W = K x L when --world is absent)"
    )
    parser.add_argument(
        "--local-world", type=int, required=True, metavar="L", help="ranks per node"
    )
    parser.add_argument("--node", type=int, default=0, metavar="N", help="node to plan (default 0)")
    parser.add_argument(
        "--mesh", type=_mesh, metavar="AxB", help="device mesh shape (default: W, one dim)"
    )
    parser.add_argument(
        "--place",
        type=_rule,
        action="append",
        default=[],
        metavar="REGEX=PLACEMENTS",
        help="placements per mesh dim for matching tensors, e.g. 'proj=[Shard(0),Shard(1)]'",
    )
    for flag, what in (
        ("--tp", "tensor parallel"),
        ("--fsdp", "fully sharded data parallel"),
        ("--ep", "expert parallel"),
        ("--dp-replicate", "replicated data parallel (HSDP)"),
    ):
        parser.add_argument(
            flag, type=int, metavar="N", help=f"transformers {what} size (model directories)"
        )
    parser.add_argument(
        "--vllm",
        action="store_true",
        help="plan a vLLM server's ranks (--tp, --pp, --dp; --ep N: expert parallel over "
        "the TP ranks, N = TP), from the dry run its workers run (vLLM installed)",
    )
    parser.add_argument("--pp", type=int, metavar="N", help="vLLM pipeline parallel size")
    parser.add_argument("--dp", type=int, metavar="N", help="vLLM data parallel replicas")
    parser.add_argument("--ep-filter", action="store_true", help="vLLM's --enable-ep-weight-filter")
    parser.add_argument(
        "--seek-cost",
        type=size,
        default=DEFAULT_SEEK_COST,
        metavar="SIZE",
        help="price of one seek in bytes (default 12MiB; measure with `spanwarm calibrate`)",
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.set_defaults(run=run)


_SIZES = {
    "tp": "tp_size",
    "fsdp": "fsdp_size",
    "ep": "ep_size",
    "dp_replicate": "dp_replicate_size",
}


def _sizes(args: argparse.Namespace) -> tuple[dict[str, int], int, range]:
    """transformers' distributed config sizes, the world they make, and the node's ranks."""
    if args.place or args.mesh:
        raise ValueError("--place and --mesh do not apply to --tp/--fsdp/--ep/--dp-replicate")
    if not os.path.isfile(os.path.join(args.checkpoint, "config.json")):
        raise ValueError(f"{args.checkpoint} has no config.json: not a transformers model")
    sizes = {
        key: getattr(args, flag) for flag, key in _SIZES.items() if getattr(args, flag) is not None
    }
    if any(n < 1 for n in sizes.values()):
        raise ValueError("--tp, --fsdp, --ep and --dp-replicate must be >= 1")
    world = sizes.get("tp_size", 1) * sizes.get("fsdp_size", 1)
    world *= sizes.get("dp_replicate_size", 1)
    if args.world is not None and args.world != world:
        raise ValueError(f"{args.world} ranks in all, but the sizes make {world}")
    if args.local_world < 1 or world % args.local_world:
        raise ValueError(f"--local-world {args.local_world} does not divide the {world} ranks")
    if not 0 <= args.node < world // args.local_world:
        raise ValueError(f"--node {args.node} is outside 0..{world // args.local_world - 1}")
    ranks = range(args.node * args.local_world, (args.node + 1) * args.local_world)
    return sizes, world, ranks


def _transformers_plan(args: argparse.Namespace, checkpoint: Checkpoint) -> NodePlan:
    """Every rank of the node planned through transformers' own distributed loading, as
    each asks the daemon (the first page each slice faults in included)."""
    sizes, world, ranks = _sizes(args)
    from spanwarm.integrations.transformers.whatif import rank_load_spans

    with _quiet_transformers():
        per_rank = rank_load_spans(
            args.checkpoint, checkpoint, sizes, world=world, ranks=ranks, first_pages=True
        )
    spans = (s for rank_spans in per_rank.values() for s in rank_spans)
    return plan_node_spans(
        checkpoint, spans, node=args.node, ranks=list(ranks), seek_cost=args.seek_cost
    )


def _vllm_plan(args: argparse.Namespace) -> NodePlan:
    """Every rank of the node as a vLLM worker reads: the plugin's dry run, per rank."""
    from spanwarm.integrations.vllm.whatif import Layout, deployment_spans

    if args.place or args.mesh or args.fsdp or args.dp_replicate:
        raise ValueError("--vllm plans --tp, --pp, --dp and --ep only")
    tp = args.tp or 1
    if args.ep is not None and args.ep != tp:
        raise ValueError(f"vLLM's expert parallel size is its TP size ({tp}), not {args.ep}")
    layout = Layout(tp, args.pp or 1, args.dp or 1, args.ep is not None, args.ep_filter)
    layout.check()
    if args.world is not None and args.world != layout.world:
        raise ValueError(f"{args.world} ranks in all, but the layout makes {layout.world}")
    if args.local_world < 1 or layout.world % args.local_world:
        raise ValueError(f"--local-world {args.local_world} does not divide {layout.world} ranks")
    if not 0 <= args.node < layout.world // args.local_world:
        raise ValueError(f"--node {args.node} is outside 0..{layout.world // args.local_world - 1}")
    ranks = list(range(args.node * args.local_world, (args.node + 1) * args.local_world))
    model = os.path.abspath(args.checkpoint)
    try:
        per_rank = deployment_spans(model, layout, ranks)
    except RuntimeError as exc:
        raise ValueError(str(exc)) from None
    spans = (s for rank_spans in per_rank.values() for s in rank_spans)
    return plan_node_spans(
        open_checkpoint(model), spans, node=args.node, ranks=ranks, seek_cost=args.seek_cost
    )


def _is_dcp(checkpoint: str) -> bool:
    from spanwarm.integrations.dcp.whatif import dcp_format  # no torch until it is one

    return dcp_format(checkpoint) is not None


def _dcp_plan(args: argparse.Namespace) -> NodePlan:
    """A DCP checkpoint: the load plans of the node's ranks, read as its reader reads."""
    from spanwarm.integrations.dcp.whatif import model_boxes, plan_dcp_node, rule_boxes

    if any(getattr(args, flag) is not None for flag in _SIZES):
        sizes, world, ranks = _sizes(args)
        from spanwarm.integrations.transformers.whatif import meta_model

        with _quiet_transformers(), meta_model(args.checkpoint, sizes, world=world) as (model, _):
            return plan_dcp_node(
                args.checkpoint,
                node=args.node,
                ranks=list(ranks),
                boxes_of=model_boxes(model),
                whole_bytes=False,
                seek_cost=args.seek_cost,
            )
    if args.world is None:
        raise ValueError("--world or --nodes is required (or --tp/--fsdp/--ep for a model)")
    mesh = check_layout(
        args.world, args.local_world, args.node, args.mesh, args.place, args.seek_cost
    )
    return plan_dcp_node(
        args.checkpoint,
        node=args.node,
        ranks=list(range(args.node * args.local_world, (args.node + 1) * args.local_world)),
        boxes_of=rule_boxes(args.place, mesh),
        whole_bytes=True,
        seek_cost=args.seek_cost,
    )


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers warns per rank about plan rules and init; the plan is the output here."""
    from transformers.utils import logging as tf_logging

    level = tf_logging.get_verbosity()
    tf_logging.set_verbosity(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        tf_logging.set_verbosity(level)


def run(args: argparse.Namespace) -> int:
    try:
        if args.nodes is not None:
            implied = args.nodes * args.local_world
            if args.world is not None and args.world != implied:
                raise ValueError(
                    f"--world {args.world} is not --nodes {args.nodes} x --local-world "
                    f"{args.local_world}"
                )
            args.world = implied
        if args.vllm:
            plan = _vllm_plan(args)
        elif _is_dcp(args.checkpoint):
            plan = _dcp_plan(args)
        elif any(getattr(args, flag) is not None for flag in _SIZES):
            plan = _transformers_plan(args, open_checkpoint(args.checkpoint))
        elif args.world is None:
            raise ValueError(
                "--world or --nodes is required (or --tp/--fsdp/--ep for a model directory)"
            )
        else:
            plan = plan_node(
                open_checkpoint(args.checkpoint),
                world=args.world,
                local_world=args.local_world,
                node=args.node,
                mesh_shape=args.mesh,
                rules=args.place,
                seek_cost=args.seek_cost,
            )
    except ImportError as exc:
        print(
            f"spanwarm plan: error: {exc} (pip install 'spanwarm[transformers]')", file=sys.stderr
        )
        return 2
    except ValueError as exc:
        print(f"spanwarm plan: error: {exc}", file=sys.stderr)
        return 2
    except (CheckpointError, OSError) as exc:
        print(f"spanwarm plan: {exc}", file=sys.stderr)
        return 1
    if args.json:
        json.dump(plan.to_json(), sys.stdout, indent=2)
        print()
    else:
        print(render(plan))
    return 0


def render(plan: NodePlan) -> str:
    """The plan as a table for people."""
    header = ("file", "size", "needed", "runs", "cost", "decision", "warm")
    rows: list[tuple[str, ...]] = [
        (
            os.path.basename(f.path),
            format_bytes(f.size_bytes),
            format_bytes(f.needed_bytes),
            str(f.num_runs),
            format_bytes(f.cost_bytes),
            f.decision,
            format_bytes(f.warm_bytes),
        )
        for f in plan.files
    ]
    total_size = sum(f.size_bytes for f in plan.files)
    rows.append(
        (
            "total",
            format_bytes(total_size),
            format_bytes(plan.needed_bytes),
            "",
            "",
            "",
            format_bytes(plan.warm_bytes),
        )
    )
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [
        f"node {plan.node}: ranks {plan.ranks[0]}..{plan.ranks[-1]}, "
        f"seek cost {format_bytes(plan.seek_cost_bytes)}",
        "",
    ]
    for i, row in enumerate([header, *rows]):
        if i == len(rows):
            lines.append("  ".join("-" * w for w in widths))
        cells = [row[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)
