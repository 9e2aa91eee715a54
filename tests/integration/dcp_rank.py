"""One rank of the DCP integration test (run under torchrun, 4 gloo CPU ranks).

A state dict on a 2x2 mesh (``[Shard(0), Shard(1)]``, ``[_StridedShard(0, sf=2),
Shard(0)]``, ``[Replicate(), Shard(1)]``, ``[Shard(0), Replicate()]``; uneven shapes,
bf16 and f32) is saved three ways: torch's distributed HF safetensors, the same with
consolidation, and DCP's native format. Each is loaded into a TP4 and an FSDP4 layout,
through ``PrefetchReader`` and through ``enable()``, with the page cache dropped first,
while what torch reads is recorded independently of spanwarm (``safe_open`` slices for
the HF readers, ``FileSystemReader._slice_file`` for the native one). Each case leaves
``<out>/<case>.rank<R>.json``: the reads, what spanwarm requested, the daemon's answer,
any value that differs from the original, and the warnings logged.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import safetensors
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.hf_storage import (
    HuggingFaceStorageReader,
    HuggingFaceStorageWriter,
)
from torch.distributed.checkpoint.quantized_hf_storage import QuantizedHuggingFaceStorageReader
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Placement, _StridedShard

import spanwarm.integrations.dcp as spanwarm_dcp
from spanwarm.client import Client
from spanwarm.integrations.dcp import DcpLoad, PrefetchReader
from spanwarm.pagecache.residency import evict
from tests.integration.rank_exit import exit_rank
from tests.integration.read_recorder import RecordingFile, reads, touched

SAVED: dict[str, tuple[list[Placement], tuple[int, ...], torch.dtype]] = {
    "layers.0.shard_shard": ([Shard(0), Shard(1)], (130, 70), torch.float32),
    "layers.0.strided": ([_StridedShard(0, split_factor=2), Shard(0)], (142, 60), torch.bfloat16),
    "layers.1.replicate_shard": ([Replicate(), Shard(1)], (90, 111), torch.bfloat16),
    "layers.1.shard_replicate": ([Shard(0), Replicate()], (71, 50), torch.float32),
    "layers.1.cube": ([Shard(2), Shard(0)], (5, 30, 93), torch.float32),
}
FORMATS = ("hf", "hf_consolidated", "native")
LAYOUTS: dict[str, Callable[[int], list[Placement]]] = {
    "tp4": lambda i: [Shard(i % 2)],  # colwise and rowwise in turn
    "fsdp4": lambda i: [Shard(0)],
}


class Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def originals() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    return {
        name: torch.randn(shape, generator=gen).to(dtype)
        for name, (_, shape, dtype) in SAVED.items()
    }


def _unstrided(value: DTensor) -> list[Placement]:
    return [Shard(p.dim) if isinstance(p, _StridedShard) else p for p in value.placements]


def save(root: Path, mesh: DeviceMesh, full: dict[str, torch.Tensor]) -> None:
    # Every rank made the same originals: each takes its own shard, no scatter.
    state = {
        name: distribute_tensor(full[name], mesh, SAVED[name][0], src_data_rank=None)
        for name in SAVED
    }
    # DCP describes a DTensor as one box, which a _StridedShard is not: like transformers'
    # save_pretrained(distributed_checkpoint=True), redistribute it to Shard first.
    state = {name: v.redistribute(placements=_unstrided(v)) for name, v in state.items()}
    hf = HuggingFaceStorageWriter(str(root / "hf"), save_distributed=True)
    dcp_save(state, storage_writer=hf)
    dcp_save(
        state,
        storage_writer=HuggingFaceStorageWriter(
            str(root / "hf_consolidated"), save_distributed=True, enable_consolidation=True
        ),
    )
    dcp_save(state, checkpoint_id=str(root / "native"))


def drop_cache(directory: Path) -> None:
    if dist.get_rank() == 0:
        for path in directory.rglob("*"):
            if path.is_file():
                evict(path)
    dist.barrier()


def reader_for(fmt: str, root: Path) -> Any:
    path = str(root / fmt)
    return FileSystemReader(path) if fmt == "native" else HuggingFaceStorageReader(path)


def record_native_reads() -> None:
    """Log every stored chunk FileSystemReader opens (torch.load reads it whole)."""
    original = FileSystemReader._slice_file

    def slice_file(self: FileSystemReader, file: Any, info: Any) -> Any:
        path = os.path.abspath(file.name)
        reads.setdefault(path, []).append((int(info.offset), int(info.offset + info.length)))
        return original(self, file, info)

    FileSystemReader._slice_file = slice_file  # type: ignore[method-assign,assignment]


def targets(mesh: DeviceMesh, layout: str, full: dict[str, torch.Tensor]) -> dict[str, Any]:
    place = LAYOUTS[layout]
    return {
        name: distribute_tensor(torch.zeros_like(value), mesh, place(i))
        for i, (name, value) in enumerate(full.items())
    }


def compare(state: dict[str, Any], full: dict[str, torch.Tensor]) -> list[str]:
    out = []
    for name, value in state.items():
        whole = value.full_tensor() if isinstance(value, DTensor) else value
        if not torch.equal(whole, full[name]):
            out.append(name)
    return out


def result(load: DcpLoad | None, state: dict[str, Any], full: Any, log: Warnings) -> dict[str, Any]:
    requested: dict[str, list[tuple[int, int]]] = {}
    for s in load.spans if load else []:
        requested.setdefault(os.path.abspath(s.path), []).extend(
            (s.offset + i * s.stride, s.offset + i * s.stride + s.length) for i in range(s.count)
        )
    progress = load.ticket.progress if load else None
    return {
        "reads": dict(reads),
        "touched": dict(touched),
        "requested": requested,
        "requested_order": list(dict.fromkeys(s.tensor for s in load.spans)) if load else [],
        "mismatched": compare(state, full),
        "groups": progress.groups if progress else 0,
        "ready": progress.ready if progress else 0,
        "failures": load.ticket.failures if load else {},
        "kind": load.kind if load else "",
        "warnings": log.messages,
    }


def run_case(
    name: str, out: Path, directory: Path, load: Callable[[], DcpLoad | None], state: Any, full: Any
) -> None:
    drop_cache(directory)
    reads.clear()
    touched.clear()
    log = Warnings()
    logging.getLogger("spanwarm").addHandler(log)
    try:
        loaded = load()
    finally:
        logging.getLogger("spanwarm").removeHandler(log)
    (out / f"{name}.rank{dist.get_rank()}.json").write_text(
        json.dumps(result(loaded, state, full, log))
    )
    dist.barrier()


def quantized(root: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """fp8 weights with 128x128-block scales; the scales in a second file."""
    path = root / "fp8"
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(300, 200, generator=gen).to(torch.float8_e4m3fn)
    scale = torch.rand(3, 2, generator=gen) + 0.5
    norm = torch.randn(200, generator=gen)
    if dist.get_rank() == 0:
        path.mkdir()
        first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
        save_file({"proj.weight": weight, "norm": norm}, str(path / first))
        save_file({"proj.weight_scale_inv": scale}, str(path / second))
        weight_map = {"proj.weight": first, "norm": first, "proj.weight_scale_inv": second}
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    dist.barrier()
    expanded = scale.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200]
    return path, {"proj.weight": weight.to(torch.float32) * expanded, "norm": norm}


def main(out: Path, socket: str) -> None:
    dist.init_process_group("gloo")
    mesh2 = init_device_mesh("cpu", (2, 2))
    mesh4 = init_device_mesh("cpu", (4,))
    full = originals()
    save(out, mesh2, full)
    dist.barrier()
    record_native_reads()
    safetensors.safe_open = RecordingFile  # type: ignore[assignment,misc]
    client = Client(socket, read_yourself=False)  # every item warmed by the daemon
    for fmt in FORMATS:
        for layout in LAYOUTS:
            state = targets(mesh4, layout, full)

            def through_reader(fmt: str = fmt, state: Any = state) -> DcpLoad | None:
                reader = PrefetchReader(reader_for(fmt, out), client=client, job="dcp-test")
                dcp_load(state, storage_reader=reader)
                return reader.loads[-1] if reader.loads else None

            run_case(f"{fmt}-{layout}-reader", out, out / fmt, through_reader, state, full)
            state = targets(mesh4, layout, full)

            def through_enable(fmt: str = fmt, state: Any = state) -> DcpLoad | None:
                with spanwarm_dcp.prefetch(client, job="dcp-test") as session:
                    if fmt == "native":  # the reader inferred from checkpoint_id
                        dcp_load(state, checkpoint_id=str(out / fmt))
                    else:
                        dcp_load(state, storage_reader=reader_for(fmt, out))
                loads = session.readers[-1].loads if session.readers else []
                return loads[-1] if loads else None

            run_case(f"{fmt}-{layout}-enable", out, out / fmt, through_enable, state, full)

    fp8, expected = quantized(out)
    state = {
        "proj.weight": distribute_tensor(torch.zeros(300, 200), mesh4, [Shard(0)]),
        "norm": distribute_tensor(torch.zeros(200), mesh4, [Replicate()]),
    }

    def through_quantized() -> DcpLoad | None:
        reader = PrefetchReader(QuantizedHuggingFaceStorageReader(str(fp8)), client=client)
        dcp_load(state, storage_reader=reader)
        return reader.loads[-1] if reader.loads else None

    run_case("fp8-tp4-reader", out, fp8, through_quantized, state, expected)

    # No daemon listening: the same load, released at once, said once.
    state = targets(mesh4, "tp4", full)

    def without_daemon(state: Any = state) -> DcpLoad | None:
        absent = Client(str(out / "absent.sock"))
        reader = PrefetchReader(reader_for("hf", out), client=absent)
        dcp_load(state, storage_reader=reader)
        return reader.loads[-1] if reader.loads else None

    run_case("no-daemon", out, out / "hf", without_daemon, state, full)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
    exit_rank()
