"""Read a native DCP checkpoint's ``.metadata`` without running what it names.

torch pickles ``Metadata`` into ``.metadata`` and ``FileSystemReader.read_metadata``
unpickles it with ``pickle.load``: any callable the file names runs. A training job
trusts its own checkpoint; ``spanwarm plan`` may be pointed at any directory (by root,
on a shared node), so the file is read with these limits:

- only what DCP's metadata is made of may be named: the classes of
  ``torch.distributed.checkpoint.metadata``, ``_StorageInfo``, ``torch.Size``, dtypes,
  layouts and paths;
- state is set (pickle's ``BUILD``) only on instances of DCP's metadata classes, never on
  a class itself (which would rebind it for the rest of the process);
- no tensor entry or chunk list may be shared between keys through the pickle memo: a
  few KiB could otherwise stand for millions of chunks.

Anything else is a :class:`~spanwarm.errors.MetadataFormatError` naming the file. The
pure-Python unpickler is used because only it lets ``BUILD`` be checked.
"""

from __future__ import annotations

import importlib
import os
import pickle
from typing import Any, ClassVar

from spanwarm.errors import MetadataFormatError

__all__ = ["load_metadata"]

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_STORAGE_INFO = ("torch.distributed.checkpoint.filesystem", "_StorageInfo")
_ALLOWED = {
    _STORAGE_INFO,
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout by name: torch.strided, ...
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}
_Unpickler: Any = pickle._Unpickler


def _allowed(module: str, name: str) -> bool:
    import torch

    if (module, name) in _ALLOWED:
        return True
    if module == "torch":
        return isinstance(getattr(torch, name, None), torch.dtype)
    if module == _METADATA_MODULE:  # its dataclasses and enums, nothing it imported
        value = getattr(importlib.import_module(module), name, None)
        return isinstance(value, type) and value.__module__ == module
    return False


class _MetadataUnpickler(_Unpickler):  # type: ignore[misc]
    dispatch: ClassVar[dict[int, Any]] = dict(_Unpickler.dispatch)

    def __init__(self, file: Any, path: str) -> None:
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        if not _allowed(module, name):
            raise MetadataFormatError(
                self._path, f"names {module}.{name}, which DCP metadata never holds"
            )
        return super().find_class(module, name)

    def _load_build(self) -> None:
        target = self.stack[-2]
        kind = type(target)
        if isinstance(target, type) or not (
            kind.__module__ == _METADATA_MODULE or (kind.__module__, kind.__name__) == _STORAGE_INFO
        ):
            raise MetadataFormatError(
                self._path, f"sets state on {kind.__name__} {target!r:.60}, which DCP never does"
            )
        _Unpickler.load_build(self)

    dispatch[pickle.BUILD[0]] = _load_build


def _check_unshared(path: str, metadata: Any) -> None:
    """Every tensor entry and chunk list is its own object (torch never shares them)."""
    seen: set[int] = set()
    for key, entry in metadata.state_dict_metadata.items():
        chunks = getattr(entry, "chunks", None)
        for obj in (entry, chunks, *(chunks or ())):
            if obj is None:
                continue
            if id(obj) in seen:
                raise MetadataFormatError(path, f"{key!r} shares its entry or chunks with another")
            seen.add(id(obj))


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
    if not isinstance(metadata.state_dict_metadata, dict) or not isinstance(
        metadata.storage_data, dict
    ):
        raise MetadataFormatError(name, "state_dict_metadata or storage_data is not a dict")
    _check_unshared(name, metadata)
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    return metadata
