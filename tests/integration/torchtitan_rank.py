"""One rank of the torchtitan test (torchrun, 4 gloo CPU ranks): torchtitan 0.3.0's own
``CheckpointManager.load`` with ``spanwarm.integrations.dcp.enable()`` and a real daemon.

A tiny tensor-parallel model (colwise then rowwise) is imported from an HF safetensors
checkpoint (``initial_load_path`` + ``initial_load_in_hf``: ``dcp.load`` with the state
dict adapter's ``HuggingFaceStorageReader``) and resumed from a native DCP step
(``folder/step-10``: ``dcp.load(state_dict, checkpoint_id=...)``). What torch reads is
recorded independently of spanwarm; each case leaves ``<out>/<case>.rank<R>.json``.
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
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from torchtitan.components.checkpoint import (
    DATALOADER,
    LR_SCHEDULER,
    OPTIMIZER,
    CheckpointManager,
)

import spanwarm.integrations.dcp as spanwarm_dcp
from spanwarm.client import Client
from spanwarm.pagecache.residency import evict
from tests.integration.dcp_rank import Warnings, record_native_reads, result
from tests.integration.rank_exit import exit_rank
from tests.integration.read_recorder import RecordingFile, reads, touched


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(96, 200, bias=False)
        self.down = nn.Linear(200, 96, bias=False)


class PrefixAdapter:
    """What a torchtitan model's state dict adapter does, minus the model: HF keys are
    ``model.<key>``, read with ``HuggingFaceStorageReader``."""

    fqn_to_index_mapping = None

    def __init__(self, hf_assets_path: str) -> None:
        self.hf_assets_path = hf_assets_path

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return {f"model.{k}": v for k, v in state_dict.items()}

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        return {k.removeprefix("model."): v for k, v in hf_state_dict.items()}

    def get_hf_storage_reader(self, path: str, from_quantized: bool = False) -> Any:
        return HuggingFaceStorageReader(path)


def model(mesh: Any, values: dict[str, torch.Tensor] | None) -> nn.Module:
    torch.manual_seed(3)
    tiny = Tiny()
    with torch.no_grad():
        for name, p in tiny.named_parameters():
            p.copy_(values[name] if values is not None else torch.zeros_like(p))
    plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    return parallelize_module(tiny, mesh, plan)


def manager(tiny: nn.Module, folder: Path, **config: Any) -> CheckpointManager:
    return CheckpointManager(
        CheckpointManager.Config(
            enable=True,
            folder=str(folder),
            keep_latest_k=0,
            exclude_from_loading=[OPTIMIZER, LR_SCHEDULER, DATALOADER],
            **config,
        ),
        dataloader=None,
        model_parts=[tiny],
        optimizers=None,
        lr_schedulers=None,
        states={},
        sd_adapter=PrefixAdapter(config.get("initial_load_path", "")),
        base_folder="",
    )


def main(out: Path, socket: str) -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (4,))
    torch.manual_seed(0)
    originals = {k: v.detach().clone() for k, v in Tiny().state_dict().items()}
    hf, folder = out / "hf", out / "ckpt"
    if dist.get_rank() == 0:
        hf.mkdir()
        save_file({f"model.{k}": v for k, v in originals.items()}, str(hf / "model.safetensors"))
    dcp_save(model(mesh, originals).state_dict(), checkpoint_id=str(folder / "step-10"))
    dist.barrier()
    record_native_reads()
    safetensors.safe_open = RecordingFile  # type: ignore[assignment,misc]
    session = spanwarm_dcp.enable(Client(socket, read_yourself=False), job="titan-test")
    cases = {
        "titan-hf-import": (hf, {"initial_load_path": str(hf), "initial_load_in_hf": True}),
        "titan-dcp-resume": (folder, {}),
    }
    for name, (directory, config) in cases.items():
        if dist.get_rank() == 0:
            for path in directory.rglob("*"):
                if path.is_file():
                    evict(path)
        dist.barrier()
        reads.clear()
        touched.clear()
        tiny = model(mesh, None)
        log = Warnings()
        logging.getLogger("spanwarm").addHandler(log)
        before = len(session.readers)
        loaded = manager(tiny, out / "empty" if config else folder, **config).load()
        logging.getLogger("spanwarm").removeHandler(log)
        assert loaded, name
        new = [load for reader in session.readers[before:] for load in reader.loads]
        state = {
            k: v.full_tensor() if isinstance(v, DTensor) else v
            for k, v in tiny.state_dict().items()
        }
        outcome = result(new[-1] if new else None, state, originals, log)
        outcome["loads"] = len(new)
        (out / f"{name}.rank{dist.get_rank()}.json").write_text(json.dumps(outcome))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
    exit_rank()
