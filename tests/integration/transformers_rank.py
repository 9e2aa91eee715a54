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
import struct
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import transformers
from safetensors import safe_open
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor
from transformers import DistributedConfig, modeling_utils

import spanwarm.integrations.transformers as spanwarm_tf
from spanwarm.client import Client

_ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "I8": 1, "U8": 1}
reads: dict[str, list[tuple[int, int]]] = {}
read_order: list[str] = []  # tensors in the order of their first read


def _header(path: str) -> tuple[int, dict[str, Any]]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return 8 + n, json.loads(f.read(n))


class RecordingSlice:
    """Logs the bytes behind every index a reader asks of one tensor."""

    def __init__(self, inner: Any, path: str, name: str) -> None:
        data_start, header = _header(path)
        entry = header[name]
        self.inner, self.path, self.name = inner, path, name
        self.shape = entry["shape"]
        self.itemsize = _ITEMSIZE[entry["dtype"]]
        self.base = data_start + entry["data_offsets"][0]

    def __getitem__(self, index: Any) -> Any:
        if self.name not in read_order:
            read_order.append(self.name)
        index = index if isinstance(index, tuple) else (index,)
        if index == (Ellipsis,):
            index = ()
        padded = [*index, *[slice(None)] * (len(self.shape) - len(index))]
        ranges = [range(*s.indices(n)) for s, n in zip(padded, self.shape, strict=True)]
        strides = np.cumprod([1, *self.shape[::-1]])[:-1][::-1]
        flat = np.zeros([len(r) for r in ranges], dtype=np.int64)
        for dim, (r, stride) in enumerate(zip(ranges, strides, strict=True)):
            axis = [1] * len(ranges)
            axis[dim] = len(r)
            flat = flat + (np.asarray(r, dtype=np.int64) * stride).reshape(axis)
        elements = np.unique(flat.ravel())
        if elements.size:
            breaks = np.flatnonzero(np.diff(elements) != 1)
            starts = elements[np.r_[0, breaks + 1]]
            stops = elements[np.r_[breaks, elements.size - 1]] + 1
            reads.setdefault(self.path, []).extend(
                (self.base + int(a) * self.itemsize, self.base + int(b) * self.itemsize)
                for a, b in zip(starts, stops, strict=True)
            )
        return self.inner[index if index else ...]

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.inner, attr)


class RecordingFile:
    def __init__(self, path: str, *args: Any, **kwargs: Any) -> None:
        self.inner = safe_open(path, *args, **kwargs)
        self.path = os.path.abspath(path)

    def get_slice(self, name: str) -> RecordingSlice:
        return RecordingSlice(self.inner.get_slice(name), self.path, name)  # type: ignore[no-untyped-call]

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.inner, attr)


class Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def run_case(case: dict[str, Any], out: Path, prefetch: spanwarm_tf.Prefetch) -> None:
    reads.clear()
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
    prefetch = spanwarm_tf.enable(Client(sys.argv[3]), job="tf-test")
    assert prefetch.active
    for case in cases:
        run_case(case, out, prefetch)
    # Once more with no daemon listening: the load must go on unchanged.
    spanwarm_tf.disable()
    absent = spanwarm_tf.enable(Client(str(out / "absent.sock")), job="tf-test")
    run_case({**cases[-1], "name": "no-daemon"}, out, absent)


if __name__ == "__main__":
    main()
