"""A benchmark-only vLLM plugin: each worker logs how long loading its model took, the
same way for every load format (vLLM logs "Loading weights took" for its default loader
only). The time is the model runner's ``load_model``: building the model, reading the
weights (and, with spanwarm, its dry run), and their processing after the load.

On where ``SPANWARM_BENCH_TIMING=1`` (bench/bench_vllm_load.py puts this folder on
PYTHONPATH, where its dist-info registers the entry point). Logs
``spanwarm-bench: rank R loaded its model in S s``.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from typing import Any


def register() -> None:
    if os.environ.get("SPANWARM_BENCH_TIMING") != "1":
        return
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    original = CPUModelRunner.load_model
    if getattr(original, "_timed", False):
        return

    @functools.wraps(original)
    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        import torch.distributed as dist

        began = time.monotonic()
        try:
            return original(self, *args, **kwargs)
        finally:
            rank = dist.get_rank() if dist.is_initialized() else 0
            seconds = time.monotonic() - began
            line = f"spanwarm-bench: rank {rank} loaded its model in {seconds:.3f} s"
            print(line, file=sys.stderr, flush=True)

    load_model._timed = True  # type: ignore[attr-defined]
    CPUModelRunner.load_model = load_model
