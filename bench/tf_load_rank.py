"""One local rank of bench_transformers_load.py: a real ``from_pretrained`` of its shards.

    python bench/tf_load_rank.py MODEL_DIR --arm none|whole|spanwarm --rank R \
        --local-rank L --local-world LW --world W --barrier DIR [--socket S]

torch's fake process group stands in for the other ranks of the job (their collectives
are no-ops), so this process is exactly global rank R of a W-rank job as far as
transformers' distributed loading and its reads are concerned. After imports it waits at
a file barrier, then loads with ``DistributedConfig(fsdp_size=W, ep_size=4)``:

- ``none``: transformers alone, cold;
- ``whole``: the seed's base PR first reads ``files[local_rank::local_world]`` whole;
- ``spanwarm``: with ``spanwarm.integrations.transformers`` enabled.

Prints one JSON line: start (monotonic clock, comparable across processes), seconds to
load, the rank's CPU seconds meanwhile, seconds the loader waited for readiness, tensors
it read itself before they were warm, bytes requested.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Run as a script, bench/ is on the path but its parent (for bench.e2e_rank) is not.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
import transformers
from torch.testing._internal.distributed.fake_pg import FakeStore
from transformers import DistributedConfig

import spanwarm.integrations.transformers as spanwarm_tf
from bench.e2e_rank import rank_arguments, read_whole, start_together
from spanwarm.client import Client

EP = 4


def main() -> None:
    args = rank_arguments().parse_args()  # the model directory is its "checkpoint"
    transformers.utils.logging.set_verbosity(logging.ERROR)
    os.environ.update(LOCAL_RANK=str(args.local_rank), RANK=str(args.rank))
    dist.init_process_group("fake", store=FakeStore(), rank=args.rank, world_size=args.world)
    config = transformers.AutoConfig.from_pretrained(args.checkpoint)
    model_class = getattr(transformers, config.architectures[0])
    session = (
        spanwarm_tf.enable(Client(args.socket), job="bench") if args.arm == "spanwarm" else None
    )

    start = start_together(args.barrier, args.local_rank, args.local_world)
    cpu_start = time.process_time()  # the rank's CPU (all threads) from here to the end
    if args.arm == "whole":
        shards = sorted(args.checkpoint.glob("*.safetensors"))
        read_whole(shards[args.local_rank :: args.local_world])
    model_class.from_pretrained(
        args.checkpoint,
        distributed_config=DistributedConfig(fsdp_size=args.world, ep_size=EP),
        dtype=torch.bfloat16,
    )
    total = time.monotonic() - start
    cpu = time.process_time() - cpu_start
    load = session.loads[-1] if session is not None else None
    print(
        json.dumps(
            {
                "start": start,
                "total_s": total,
                "cpu_s": cpu,
                "waited_s": load.waited_s if load else 0.0,
                "read_yourself": load.read_yourself if load else 0,
                "requested_bytes": load.requested_bytes if load else 0,
            }
        )
    )


if __name__ == "__main__":
    main()
