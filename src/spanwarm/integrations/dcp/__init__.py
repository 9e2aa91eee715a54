"""torch Distributed Checkpoint: prefetch exactly what every ``dcp.load`` reads.

    import spanwarm.integrations.dcp as spanwarm_dcp

    spanwarm_dcp.enable()  # every dcp.load in this process; or `with spanwarm_dcp.prefetch():`
    dcp.load(state_dict, checkpoint_id=path)  # or storage_reader=HuggingFaceStorageReader(path)

    # or one load, explicitly:
    reader = spanwarm_dcp.PrefetchReader(HuggingFaceStorageReader(path))
    dcp.load(state_dict, storage_reader=reader)

Each rank requests, once its final load plan is known and before any data byte is read,
exactly the bytes its reader will read for that plan (DCP's native ``.distcp`` format,
torch's Hugging Face safetensors readers, quantized included), in the order it reads
them; each read waits only for its own item. torch is imported on first use, so
``spanwarm plan`` can look for DCP checkpoints without it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from spanwarm.integrations.dcp.hooks import Prefetch, disable, enable, prefetch
    from spanwarm.integrations.dcp.reader import DcpLoad, PrefetchReader

__all__ = ["DcpLoad", "Prefetch", "PrefetchReader", "disable", "enable", "prefetch"]

_HOME = {
    "DcpLoad": "reader",
    "PrefetchReader": "reader",
    "Prefetch": "hooks",
    "disable": "hooks",
    "enable": "hooks",
    "prefetch": "hooks",
}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
