"""One rank of the transformers distributed-checkpoint test (torchrun, 4 gloo CPU ranks).

Each tiny model is loaded under TP2 x FSDP2, saved with ``save_pretrained(...,
distributed_checkpoint=True)`` and loaded back from that directory under TP4 and FSDP4
with spanwarm's transformers integration enabled and a real daemon, the page cache
dropped first. What torch's DCP reader reads is recorded through ``safe_open``
independently of spanwarm. Each case leaves ``<out>/<case>.rank<R>.json``.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import safetensors
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, DistributedConfig

import spanwarm.integrations.transformers as spanwarm_tf
from spanwarm.client import Client
from spanwarm.integrations.dcp import DcpLoad
from spanwarm.pagecache.residency import evict
from tests.integration.rank_exit import exit_rank
from tests.integration.read_recorder import RecordingFile, reads, touched

SAVED_WITH: dict[str, Any] = {"tp_size": 2, "fsdp_size": 2}
LOADED_WITH: dict[str, dict[str, Any]] = {"tp4": {"tp_size": 4}, "fsdp4": {"fsdp_size": 4}}


class Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def load(directory: Path | str, distributed: dict[str, Any]) -> Any:
    return AutoModelForCausalLM.from_pretrained(
        str(directory), distributed_config=DistributedConfig(**distributed), dtype=torch.bfloat16
    )


def run_case(case: dict[str, Any], out: Path, prefetch: spanwarm_tf.Prefetch) -> None:
    saved = out / f"{case['name']}-dcp"
    model = load(case["dir"], SAVED_WITH)
    model.save_pretrained(saved, distributed_checkpoint=True)
    del model
    dist.barrier()
    reference = load_file(case["reference"])
    for layout, distributed in LOADED_WITH.items():
        if dist.get_rank() == 0:
            for path in saved.glob("*.safetensors"):
                evict(path)
        dist.barrier()
        reads.clear()
        touched.clear()
        log = Warnings()
        logging.getLogger("spanwarm").addHandler(log)
        before = len(prefetch.loads)
        model = load(saved, distributed)
        logging.getLogger("spanwarm").removeHandler(log)
        records = prefetch.loads[before:]
        record = records[-1] if records else None
        mismatched = [
            key
            for key, value in model.state_dict().items()
            if not torch.equal(
                value.full_tensor() if isinstance(value, DTensor) else value, reference[key]
            )
        ]
        requested: dict[str, list[tuple[int, int]]] = {}
        for s in record.spans if record else []:
            requested.setdefault(s.path, []).extend(
                (s.offset + i * s.stride, s.offset + i * s.stride + s.length)
                for i in range(s.count)
            )
        progress = record.ticket.progress if record else None
        result = {
            "loads": len(records),
            "dcp": isinstance(record, DcpLoad),
            "reads": dict(reads),
            "touched": dict(touched),
            "requested": requested,
            "mismatched": mismatched,
            "compared": len(model.state_dict()),
            "groups": progress.groups if progress else 0,
            "ready": progress.ready if progress else 0,
            "failures": record.ticket.failures if record else {},
            "warnings": log.messages,
        }
        name = f"{case['name']}-{layout}.rank{dist.get_rank()}.json"
        (out / name).write_text(json.dumps(result))
        del model
        dist.barrier()


def main() -> None:
    cases = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    dist.init_process_group("gloo")
    safetensors.safe_open = RecordingFile  # type: ignore[assignment,misc]
    prefetch = spanwarm_tf.enable(Client(sys.argv[3], read_yourself=False), job="tf-dcp-test")
    assert prefetch.active
    for case in cases:
        run_case(case, out, prefetch)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_rank()
