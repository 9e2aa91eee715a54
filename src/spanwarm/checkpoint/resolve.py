"""A checkpoint from what a caller names: a directory (with ``model.safetensors.index.json``
or ``*.safetensors``), an index, one file or a list of files; its files' headers read
(:mod:`.safetensors_header`) and where each tensor is stored. Shards an index names must
lie inside the checkpoint (or the Hugging Face hub cache's blobs of its snapshot).
"""

from __future__ import annotations

import json
import os
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from spanwarm.checkpoint.safetensors_header import (
    DCP_SHARDING_INFO,
    Header,
    HeaderCache,
    TensorInfo,
    read_header,
)
from spanwarm.errors import (
    DuplicateTensorError,
    IndexFormatError,
    NoShardsError,
    ShardMissingError,
    ShardOutsideCheckpointError,
)

__all__ = ["INDEX_FILE", "Checkpoint", "checkpoint_files", "open_checkpoint", "read_index"]

INDEX_FILE = "model.safetensors.index.json"
_QUICK_HEADER_S = 0.001


def _inside(path: str, directory: str | None) -> bool:
    return directory is not None and os.path.commonpath([path, directory]) == directory


def _hub_blobs(real_root: str) -> str | None:
    """Where a Hugging Face hub cache keeps the files of snapshot ``real_root``
    (``<repo>/snapshots/<revision>``, whose entries are links to ``../../blobs/<hash>``):
    a shard may resolve there too. None for any other directory."""
    snapshots = os.path.dirname(real_root)
    if os.path.basename(snapshots) != "snapshots":
        return None
    return os.path.join(os.path.dirname(snapshots), "blobs")


def _shard_path(root: Path, index: Path, name: str) -> str:
    if "/" not in name and name not in (".", ".."):  # in the directory itself: no pathlib
        top = str(root)
        joined = name if top == "." else os.path.join(top, name)  # as str(root / name)
        try:
            if not stat.S_ISLNK(os.lstat(joined).st_mode):
                return joined  # no link: inside, and there
        except FileNotFoundError:
            raise ShardMissingError(index, f"shard {name!r} does not exist") from None
    if os.path.isabs(name) or ".." in Path(name).parts:
        raise ShardOutsideCheckpointError(index, f"shard {name!r} is outside {root}")
    path = root / name
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise ShardMissingError(index, f"shard {name!r} does not exist") from None
    if not stat.S_ISLNK(st.st_mode) and len(Path(name).parts) == 1:
        return str(path)  # a name in the directory itself, no link: inside, and there
    real, real_root = os.path.realpath(path), os.path.realpath(root)
    if not _inside(real, real_root) and not _inside(real, _hub_blobs(real_root)):
        raise ShardOutsideCheckpointError(
            index, f"shard {name!r} resolves to {real}, outside {real_root}"
        )
    if not os.path.exists(real):
        raise ShardMissingError(index, f"shard {name!r} is a dangling symlink")
    return str(path)


class _Memo:
    """At most ``size`` entries, the least recently used dropped first; thread-safe."""

    def __init__(self, size: int) -> None:
        self._entries: OrderedDict[Any, Any] = OrderedDict()
        self._lock = threading.Lock()
        self._size = size

    def get(self, key: Any) -> Any:
        with self._lock:
            value = self._entries.get(key)
            if value is not None:
                self._entries.move_to_end(key)
            return value

    def put(self, key: Any, value: Any) -> None:
        with self._lock:
            self._entries[key] = value
            while len(self._entries) > self._size:
                self._entries.popitem(last=False)


# Shard names per index file, keyed as the header cache keys a file (a rewritten index
# misses): a loader opens one checkpoint more than once (its own pass, then spanwarm's),
# and parsing a weight map of thousands of keys costs a millisecond. Paths are still
# resolved and checked on every call (a shard may be swapped for a link since).
_INDEX_NAMES = _Memo(64)


def _index_names(index_path: Path) -> tuple[str, ...]:
    """The sorted shard names of an index's weight map, validated as JSON (memoised)."""
    # O_NONBLOCK: a FIFO in the index's place must not hang the loader; refused below.
    fd = os.open(index_path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise IndexFormatError(index_path, "is not a regular file")
        key = (str(index_path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        known: tuple[str, ...] | None = _INDEX_NAMES.get(key)
        if known is not None:
            return known  # a hit: no file object to build
        with open(fd, "rb", closefd=False) as f:
            raw = f.read()
    finally:
        os.close(fd)
    try:
        document = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise IndexFormatError(index_path, f"not a JSON document: {exc}") from exc
    weight_map = document.get("weight_map") if isinstance(document, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise IndexFormatError(index_path, "no weight_map object of tensor names to shard files")
    for value in weight_map.values():
        if not isinstance(value, str) or not value:
            raise IndexFormatError(index_path, f"weight_map value {value!r} is not a file name")
    names = tuple(sorted(set(weight_map.values())))  # shared by every later caller
    _INDEX_NAMES.put(key, names)
    return names


def read_index(index: str | os.PathLike[str]) -> list[str]:
    """Shard paths named by a ``model.safetensors.index.json``, sorted and validated.

    Every shard must exist and stay inside the index's directory after resolving
    symlinks (or, for a Hugging Face hub snapshot, inside its repo's ``blobs``); names
    are never trusted as paths.
    """
    index_path = Path(index)
    root = index_path.parent
    return [_shard_path(root, index_path, name) for name in _index_names(index_path)]


def checkpoint_files(
    checkpoint: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
) -> list[str]:
    """The safetensors files of a checkpoint: a directory, one file, or a list of files.

    A directory is read through its ``model.safetensors.index.json`` when it has one,
    otherwise every ``*.safetensors`` file in it, sorted by name.
    """
    if isinstance(checkpoint, (str, os.PathLike)):
        path = Path(checkpoint)
        if path.is_dir():
            index = path / INDEX_FILE
            if index.exists():
                return read_index(index)
            files = sorted(str(p) for p in path.glob("*.safetensors"))
            if not files:
                raise NoShardsError(path, f"no {INDEX_FILE} and no *.safetensors files")
            return files
        if not path.exists():
            raise ShardMissingError(path, "no such file or directory")
        return [str(path)]
    files = [os.fspath(p) for p in checkpoint]
    if not files:
        raise ValueError("checkpoint: an empty list of files")
    return files


@dataclass(frozen=True)
class Checkpoint:
    """The validated headers of every file of a checkpoint and where each tensor lives."""

    headers: tuple[Header, ...]
    pieces: Mapping[str, tuple[tuple[Header, TensorInfo], ...]]

    @property
    def paths(self) -> list[str]:
        return [h.path for h in self.headers]


def _locate_tensors(
    headers: Iterable[Header],
) -> Mapping[str, tuple[tuple[Header, TensorInfo], ...]]:
    """Where each tensor is stored. A tensor stored whole in a file of its own kind and as
    DCP chunks too is a consolidated distributed checkpoint (torch's
    ``consolidate_safetensors_files`` writing into the shards' directory): the whole copy
    is what a safetensors loader opens (the index names it; no loader reads both), so the
    chunks are left out. Any other tensor stored twice at one offset is an error."""
    located: dict[str, list[tuple[Header, TensorInfo]]] = {}
    for header in headers:
        for tensor in header.tensors:
            located.setdefault(tensor.name, []).append((header, tensor))
    for name, pieces in located.items():
        if len(pieces) == 1:
            continue
        whole = [p for p in pieces if DCP_SHARDING_INFO not in p[0].metadata]
        if whole and len(whole) < len(pieces):
            pieces[:] = whole
        offsets = [t.global_offset for _, t in pieces]
        if len(pieces) > 1 and len(set(offsets)) != len(offsets):
            first, second = pieces[0][0].path, pieces[1][0].path
            raise DuplicateTensorError(
                second, f"tensor {name!r} is stored in {first} too, with the same global offset"
            )
    return MappingProxyType({name: tuple(pieces) for name, pieces in located.items()})


# Checkpoints by their headers (the header cache's objects: one unchanged file, one
# object), so opening a checkpoint again costs its stats, not thousands of lookups. An
# entry holds its headers, so no other header can take one's id while it is here.
_CHECKPOINTS = _Memo(16)


def _checkpoint_of(headers: list[Header]) -> Checkpoint:
    key = tuple(map(id, headers))
    known: Checkpoint | None = _CHECKPOINTS.get(key)
    if known is None:
        known = Checkpoint(tuple(headers), _locate_tensors(headers))
        _CHECKPOINTS.put(key, known)
    return known


def open_checkpoint(
    checkpoint: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    *,
    cache: HeaderCache | None = None,
    max_workers: int = 16,
) -> Checkpoint:
    """Read every header of a checkpoint: in line while each is a quick cache hit, the rest
    concurrently (each is a round trip on a network mount)."""
    files = checkpoint_files(checkpoint)
    # In order on this thread while each header is a quick cache hit (a checkpoint opened
    # before: no thread pool, which costs milliseconds of handoffs), the rest concurrently.
    headers: list[Header] = []
    for path in files:
        began = time.monotonic()
        headers.append(read_header(path, cache=cache))
        if time.monotonic() - began > _QUICK_HEADER_S:
            break
    rest = files[len(headers) :]
    if len(rest) == 1:
        headers.append(read_header(rest[0], cache=cache))
    elif rest:
        with ThreadPoolExecutor(max_workers=min(max_workers, len(rest))) as pool:
            headers.extend(pool.map(lambda f: read_header(f, cache=cache), rest))
    return _checkpoint_of(headers)
