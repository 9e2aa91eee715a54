"""One rank of the transformers integration test (run under torchrun, gloo on CPU).

For every case it loads a checkpoint with ``from_pretrained(distributed_config=...)``
with spanwarm's integration enabled against a real daemon, while recording the bytes
transformers actually reads: ``safe_open`` is wrapped so every slice it hands out logs
the index transformers reads it with. Those indices become byte ranges here with numpy
and the file's own header, independently of spanwarm's span code. Each case leaves
``<out>/<case>.rank<R>.json`` with the reads, what spanwarm requested, the daemon's
answer and any weight that differs from the unsharded original. The last case is then
loaded again with no daemon listening (``no-daemon.rank<R>.json``).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import transformers
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor
from transformers import DistributedConfig, modeling_utils

import spanwarm.integrations.transformers as spanwarm_tf
from spanwarm.client import Client
from tests.integration.rank_exit import exit_rank
from tests.integration.read_recorder import RecordingFile, read_order, reads, touched


class Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def run_case(case: dict[str, Any], out: Path, prefetch: spanwarm_tf.Prefetch) -> None:
    reads.clear()
    touched.clear()
    read_order.clear()
    saved_env = {k: os.environ.get(k) for k in case.get("env", {})}
    os.environ.update(case.get("env", {}))
    warnings = Warnings()
    logging.getLogger("spanwarm").addHandler(warnings)
    model_class = getattr(transformers, case["class"])
    model = model_class.from_pretrained(
        case["dir"],
        distributed_config=DistributedConfig(**case["distributed"]),
        dtype=getattr(torch, case["dtype"]),
    )
    load = prefetch.loads[-1]
    reference = load_file(case["reference"])
    mismatched = []
    for key, value in model.state_dict().items():
        full = value.full_tensor() if isinstance(value, DTensor) else value
        if key in reference and not torch.equal(full, reference[key]):
            mismatched.append(key)
    progress = load.ticket.progress
    requested: dict[str, list[tuple[int, int]]] = {}
    for s in load.spans:
        requested.setdefault(os.path.abspath(s.path), []).extend(
            (s.offset + i * s.stride, s.offset + i * s.stride + s.length) for i in range(s.count)
        )
    result = {
        "reads": reads,
        "touched": touched,
        "read_order": read_order,
        "requested_order": list(dict.fromkeys(s.tensor for s in load.spans)),
        "requested": requested,
        "mismatched": mismatched,
        "groups": progress.groups,
        "ready": progress.ready,
        "failures": load.ticket.failures,
        "compared": sum(1 for k in model.state_dict() if k in reference),
        "warnings": warnings.messages,
    }
    logging.getLogger("spanwarm").removeHandler(warnings)
    for key, value in saved_env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    (out / f"{case['name']}.rank{dist.get_rank()}.json").write_text(json.dumps(result))
    del model
    dist.barrier()


def main() -> None:
    cases = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    modeling_utils.safe_open = RecordingFile  # type: ignore[attr-defined,assignment]
    prefetch = spanwarm_tf.enable(Client(sys.argv[3], read_yourself=False), job="tf-test")
    assert prefetch.active
    for case in cases:
        run_case(case, out, prefetch)
    # Once more with no daemon listening: the load must go on unchanged.
    spanwarm_tf.disable()
    absent = spanwarm_tf.enable(Client(str(out / "absent.sock")), job="tf-test")
    run_case({**cases[-1], "name": "no-daemon"}, out, absent)


if __name__ == "__main__":
    main()
    exit_rank()
