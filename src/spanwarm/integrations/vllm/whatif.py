"""What each rank of a vLLM deployment reads, on a machine with no GPU: the plugin's dry
run, one process per rank.

A rank's process sets up vLLM's parallel groups for its place in the layout over torch's
fake process group (no peers, no collectives: building a model and its weight loaders
need none), builds vLLM's engine configuration as ``vllm serve`` would, and runs the
same dry run as a worker does (:func:`~.dry_run.loader_dry_run`). One process per rank,
because vLLM keeps its groups in module state. ``spanwarm plan MODEL --vllm`` plans a
node from these spans.

Layouts: TP x PP, with expert parallelism over the TP ranks (``--ep``, vLLM's
``enable_expert_parallel``, and its weight filter), and DP replicas (each reads what the
first replica's rank of the same place reads). DP with EP spreads the experts over
the replicas as well; that layout is refused.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from spanwarm.checkpoint.tensor_layout import TensorSpans

__all__ = ["Layout", "deployment_spans"]


@dataclass(frozen=True)
class Layout:
    """A vLLM deployment's parallel layout."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: bool = False
    ep_filter: bool = False

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    def check(self) -> None:
        if min(self.tp, self.pp, self.dp) < 1:
            raise ValueError("--tp, --pp and --dp must be >= 1")
        if self.ep and self.dp > 1:
            raise ValueError("expert parallelism across DP replicas is not planned (use --dp 1)")
        if self.ep_filter and not self.ep:
            raise ValueError("--ep-filter needs expert parallelism")


def deployment_spans(
    model: str, layout: Layout, ranks: list[int], *, workers: int = 2
) -> dict[int, list[TensorSpans]]:
    """The spans each of ``ranks`` (global vLLM ranks) reads of ``model``'s checkpoint.
    Raises RuntimeError naming the rank whose dry run failed, with its output."""
    layout.check()
    if any(not 0 <= r < layout.world for r in ranks):
        raise ValueError(f"ranks must be in 0..{layout.world - 1}")
    # A DP replica reads what the first replica's rank of the same place reads.
    places = sorted({r % (layout.tp * layout.pp) for r in ranks})
    with ThreadPoolExecutor(max(1, workers)) as pool:
        spans = pool.map(lambda p: _rank_in_process(model, layout, p), places)
        found = dict(zip(places, spans, strict=True))
    return {r: found[r % (layout.tp * layout.pp)] for r in ranks}


def _rank_in_process(model: str, layout: Layout, rank: int) -> list[TensorSpans]:
    command = [
        sys.executable,
        "-m",
        "spanwarm.integrations.vllm.whatif",
        model,
        f"--tp={layout.tp}",
        f"--pp={layout.pp}",
        f"--rank={rank}",
        *(["--ep"] if layout.ep else []),
        *(["--ep-filter"] if layout.ep_filter else []),
    ]
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR", "SPANWARM_VLLM": "0"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith('{"spans"')]
    if done.returncode or not lines:
        output = (done.stdout + done.stderr)[-3000:]
        raise RuntimeError(f"the dry run of rank {rank} failed:\n{output}")
    record = json.loads(lines[-1])
    if not record["exact"]:
        raise RuntimeError(f"the dry run of rank {rank} cannot tell its reads: {record['reason']}")
    return [TensorSpans(*s) for s in record["spans"]]


def _dry_run_here(model: str, layout: Layout, rank: int) -> dict[str, object]:
    """In a process of its own: vLLM's groups for ``rank`` of ``layout``, then the dry run."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world = layout.tp * layout.pp
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    new_group = dist.new_group

    def fake_group(*args: object, **kwargs: object) -> object:
        kwargs["backend"] = "fake"  # vLLM asks for gloo or nccl groups: no peers here
        return new_group(*args, **kwargs)  # type: ignore[arg-type]

    dist.new_group = fake_group
    from vllm.distributed import parallel_state

    coordinator = parallel_state.GroupCoordinator.__init__

    def without_peers(self: object, *args: object, **kwargs: object) -> None:
        # No device communicator (NCCL, or the CPU's shared memory) and no message queue:
        # they reach out to peers, and a dry run sends nothing.
        kwargs.update(use_device_communicator=False, use_message_queue_broadcaster=False)
        coordinator(self, *args, **kwargs)

    parallel_state.GroupCoordinator.__init__ = without_peers
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader

    from spanwarm.integrations.vllm.dry_run import loader_dry_run
    from spanwarm.integrations.vllm.plugin import install

    install()  # the safetensors iterator that hands out meta tensors in a dry run
    config = EngineArgs(
        model=model,
        tensor_parallel_size=layout.tp,
        pipeline_parallel_size=layout.pp,
        enable_expert_parallel=layout.ep,
        enable_ep_weight_filter=layout.ep_filter,
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=256,
    ).create_engine_config()
    with set_current_vllm_config(config):
        init_distributed_environment(world, rank, "env://", rank, backend="fake")
        initialize_model_parallel(layout.tp, layout.pp, backend="fake")
        loader = get_model_loader(config.load_config)
        plan = loader_dry_run(loader, config.model_config, config, budget_s=float("inf"))
    return {
        "spans": [[s.tensor, s.path, s.offset, s.length, s.stride, s.count] for s in plan.spans],
        "exact": plan.exact,
        "reason": plan.reason,
        "seconds": plan.seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description="one rank's dry run (spanwarm plan --vllm)")
    parser.add_argument("model")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--ep", action="store_true")
    parser.add_argument("--ep-filter", action="store_true")
    args = parser.parse_args()
    layout = Layout(args.tp, args.pp, 1, args.ep, args.ep_filter)
    print(json.dumps(_dry_run_here(args.model, layout, args.rank)), flush=True)


if __name__ == "__main__":
    main()
