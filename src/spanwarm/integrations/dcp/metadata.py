"""Read a native DCP checkpoint's ``.metadata`` without running what it names.

torch pickles ``Metadata`` into ``.metadata`` and ``FileSystemReader.read_metadata``
unpickles it with ``pickle.load``: any callable the file names runs. A training job
trusts its own checkpoint; ``spanwarm plan`` may be pointed at any directory (by root,
on a shared node), so it unpickles only what DCP's metadata is made of: the classes of
``torch.distributed.checkpoint.metadata``, ``_StorageInfo``, ``torch.Size``, dtypes,
layouts and paths. Anything else is refused before it is called.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

from spanwarm.errors import MetadataFormatError

__all__ = ["load_metadata"]

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout by name: torch.strided, ...
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, path: str) -> None:
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        value = super().find_class(module, name) if self._allowed(module, name) else None
        if value is None:
            raise MetadataFormatError(
                self._path, f"names {module}.{name}, which DCP metadata never holds"
            )
        return value

    @staticmethod
    def _allowed(module: str, name: str) -> bool:
        import importlib

        import torch

        if (module, name) in _ALLOWED:
            return True
        if module == "torch":
            return isinstance(getattr(torch, name, None), torch.dtype)
        if module == _METADATA_MODULE:  # its dataclasses and enums, nothing imported
            value = getattr(importlib.import_module(module), name, None)
            return isinstance(value, type) and value.__module__ == module
        return False


def load_metadata(path: str | os.PathLike[str]) -> Any:
    """The ``Metadata`` in a ``.metadata`` file (``MetadataFormatError`` if it is not)."""
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    name = os.fspath(path)
    with open(name, "rb") as f:
        try:
            metadata = _MetadataUnpickler(f, name).load()
        except MetadataFormatError:
            raise
        except Exception as exc:  # truncated, not a pickle, a class that changed shape
            raise MetadataFormatError(name, f"not DCP metadata: {exc}") from exc
    if not isinstance(metadata, Metadata):
        raise MetadataFormatError(name, f"holds a {type(metadata).__name__}, not Metadata")
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    return metadata
