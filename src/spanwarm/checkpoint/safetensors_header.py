"""Read and validate safetensors headers (checkpoints made of them: :mod:`.resolve`).

The format (huggingface/safetensors, ``Metadata::validate``):

- bytes 0..8 MUST be a little-endian u64 ``N``, the header length, with ``N <= 100_000_000``
  and ``8 + N <= file size``;
- bytes 8..8+N MUST be a UTF-8 JSON object (padding whitespace MAY surround it) mapping
  tensor names to ``{"dtype", "shape", "data_offsets": [begin, end]}``, plus an optional
  ``__metadata__`` string-to-string map;
- offsets are relative to byte ``8 + N``; sorted by offset, the first tensor MUST begin at
  0 and each next one where the previous ends (no holes, no overlap);
- each tensor MUST occupy exactly ``numel * bits / 8`` bytes (whole bytes);
- the last tensor MUST end at the end of the file.

Each violation raises its own :mod:`spanwarm.errors` type naming the file. Torch DCP's
distributed safetensors store chunks of global tensors and record each chunk's global
offsets in ``__metadata__["DCP_SHARDING_INFO"]``; those become :attr:`TensorInfo.global_offset`.
"""

from __future__ import annotations

import json
import os
import stat
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass
from math import prod
from typing import Any

from spanwarm.errors import (
    DataSizeMismatchError,
    FileTooShortError,
    HeaderNotJsonError,
    HeaderPastEndError,
    HeaderTooLargeError,
    InvalidOffsetsError,
    InvalidTensorInfoError,
    NotARegularFileError,
    ShardMissingError,
    TensorSizeMismatchError,
    UnknownDtypeError,
)

__all__ = [
    "DTYPE_BITS",
    "MAX_HEADER_SIZE",
    "Header",
    "HeaderCache",
    "TensorInfo",
    "read_header",
]

MAX_HEADER_SIZE = 100_000_000
DCP_SHARDING_INFO = "DCP_SHARDING_INFO"

# Bits per element of every dtype the format defines (safetensors ``Dtype::bitsize``).
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "I64": 64,
    "U64": 64,
    "F64": 64,
}


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor (or one chunk of a global tensor) stored in a safetensors file.

    ``begin``/``end`` are byte offsets into the data section, as in the header;
    ``global_offset`` is where this chunk sits in the global tensor (all zeros for a
    full tensor).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int
    global_offset: tuple[int, ...]

    @property
    def bits(self) -> int:
        return DTYPE_BITS[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True, slots=True)
class Header:
    """A validated safetensors header. ``data_start`` is the file offset of the data."""

    path: str
    file_size: int
    data_start: int
    tensors: tuple[TensorInfo, ...]
    metadata: dict[str, str]

    def file_offset(self, tensor: TensorInfo) -> int:
        """File offset of the first byte of ``tensor``."""
        return self.data_start + tensor.begin


def _reject_duplicate_keys(path: str, pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)  # called for every object of the header: the loop only on a repeat
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise HeaderNotJsonError(path, f"header repeats the key {key!r}", offset=8)
            seen.add(key)
    return obj


def _is_count(value: object) -> bool:
    return type(value) is int and value >= 0  # not a bool (an int subclass), not a float


def _parse_sharding_info(path: str, metadata: dict[str, str]) -> dict[str, list[int]]:
    raw = metadata.get(DCP_SHARDING_INFO)
    if raw is None:
        return {}
    try:
        info = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise InvalidTensorInfoError(path, f"{DCP_SHARDING_INFO} is not JSON: {exc}") from exc
    if not isinstance(info, dict):
        raise InvalidTensorInfoError(path, f"{DCP_SHARDING_INFO} is not a JSON object")
    offsets: dict[str, list[int]] = {}
    for name, entry in info.items():
        saved = entry.get("saved_offsets") if isinstance(entry, dict) else None
        if not isinstance(saved, list) or not all(_is_count(v) for v in saved):
            raise InvalidTensorInfoError(
                path, f"{DCP_SHARDING_INFO}[{name!r}].saved_offsets is not a list of offsets"
            )
        offsets[name] = saved
    return offsets


def _parse_entries(path: str, header: dict[str, Any], data_start: int) -> list[TensorInfo]:
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise InvalidTensorInfoError(path, "__metadata__ is not a map of strings to strings")
    sharding = _parse_sharding_info(path, metadata)
    tensors: list[TensorInfo] = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict):
            raise InvalidTensorInfoError(path, f"tensor {name!r}: entry is not a JSON object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not isinstance(dtype, str):
            raise InvalidTensorInfoError(path, f"tensor {name!r}: dtype is not a string")
        if dtype not in DTYPE_BITS:
            raise UnknownDtypeError(path, f"tensor {name!r}: unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
            raise InvalidTensorInfoError(
                path, f"tensor {name!r}: shape is not a list of non-negative integers"
            )
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(_is_count(o) for o in offsets)
            or offsets[0] > offsets[1]
        ):
            raise InvalidTensorInfoError(
                path, f"tensor {name!r}: data_offsets is not [begin, end] with 0 <= begin <= end"
            )
        global_offset = sharding.get(name, [0] * len(shape))
        if len(global_offset) != len(shape):
            raise InvalidTensorInfoError(
                path, f"tensor {name!r}: {DCP_SHARDING_INFO} offsets do not match its rank"
            )
        tensors.append(
            TensorInfo(name, dtype, tuple(shape), offsets[0], offsets[1], tuple(global_offset))
        )
    return tensors


def _validate_layout(path: str, tensors: list[TensorInfo], data_start: int, size: int) -> None:
    tensors.sort(key=lambda t: (t.begin, t.end))
    expected = 0
    for t in tensors:
        at = data_start + t.begin
        if t.begin != expected:
            what = (
                "does not start at 0" if expected == 0 else f"leaves a gap or overlap at {expected}"
            )
            raise InvalidOffsetsError(path, f"tensor {t.name!r}: data {what}", offset=at)
        bits = prod(t.shape) * t.bits
        if bits % 8 or t.nbytes != bits // 8:
            raise TensorSizeMismatchError(
                path,
                f"tensor {t.name!r}: {t.nbytes} bytes for shape {list(t.shape)} of {t.dtype} "
                f"({bits} bits)",
                offset=at,
            )
        expected = t.end
    if data_start + expected != size:
        raise DataSizeMismatchError(
            path,
            f"data section ends at {data_start + expected} but the file is {size} bytes",
            offset=data_start + expected,
        )


def _parse_header(path: str, fd: int, size: int) -> Header:
    prefix = os.pread(fd, 8, 0)
    if len(prefix) < 8:
        raise FileTooShortError(path, f"file is {size} bytes, shorter than the 8-byte prefix")
    (length,) = struct.unpack("<Q", prefix)
    if length > MAX_HEADER_SIZE:
        raise HeaderTooLargeError(
            path, f"header length {length} exceeds the limit of {MAX_HEADER_SIZE}", offset=0
        )
    if 8 + length > size:
        raise HeaderPastEndError(
            path, f"header of {length} bytes runs past the end of the {size}-byte file", offset=0
        )
    raw = os.pread(fd, length, 8)
    if len(raw) != length:
        raise HeaderPastEndError(path, f"file shrank while reading its {length}-byte header")
    try:
        text = raw.decode("utf-8")
        header = json.loads(text, object_pairs_hook=lambda p: _reject_duplicate_keys(path, p))
    except UnicodeDecodeError as exc:
        raise HeaderNotJsonError(
            path, f"header is not UTF-8: {exc.reason}", offset=8 + exc.start
        ) from exc
    except json.JSONDecodeError as exc:
        raise HeaderNotJsonError(
            path, f"header is not JSON: {exc.msg}", offset=8 + exc.pos
        ) from exc
    if not isinstance(header, dict):
        raise HeaderNotJsonError(path, "header is not a JSON object", offset=8)
    data_start = 8 + length
    tensors = _parse_entries(path, header, data_start)
    _validate_layout(path, tensors, data_start, size)
    return Header(path, size, data_start, tuple(tensors), dict(header.get("__metadata__", {})))


class HeaderCache:
    """Validated headers keyed by (path, device, inode, size, mtime): a rewritten file misses.

    Thread-safe; least recently used entries are dropped past ``max_entries``.
    """

    def __init__(self, max_entries: int = 8192) -> None:
        self._entries: OrderedDict[tuple[str, int, int, int, int], Header] = OrderedDict()
        self._lock = threading.Lock()
        self._max_entries = max_entries
        self.hits = 0
        self.misses = 0

    def read(self, path: str | os.PathLike[str]) -> Header:
        name = os.fspath(path)
        try:  # a hit needs no descriptor: one stat (a rank opens a checkpoint twice)
            st = os.stat(name)
        except OSError:
            pass  # said precisely by the open below
        else:
            if stat.S_ISREG(st.st_mode):
                cached = self._hit((name, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
                if cached is not None:
                    return cached
        # O_NONBLOCK: opening a FIFO must not hang; it is refused right after fstat.
        try:
            fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except IsADirectoryError as exc:
            raise NotARegularFileError(name, "is a directory, not a safetensors file") from exc
        except FileNotFoundError as exc:
            raise ShardMissingError(name, "no such file") from exc
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise NotARegularFileError(name, "is not a regular file")
            key = (name, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
            cached = self._hit(key, count_miss=True)
            if cached is not None:
                return cached
            # No read-ahead on this descriptor: a read-ahead window leaves PG_readahead
            # marks on the header's pages, and the loader's first touch of one reads the
            # next 8-16 MiB past them, bytes no rank asked for.
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            header = _parse_header(name, fd, st.st_size)
        finally:
            os.close(fd)
        with self._lock:
            self._entries[key] = header
            while len(self._entries) > self._max_entries:
                self._entries.popitem(last=False)
        return header

    def _hit(
        self, key: tuple[str, int, int, int, int], *, count_miss: bool = False
    ) -> Header | None:
        """The header cached under ``key``, counted as a hit; None (a miss, counted only
        with ``count_miss``: the stat before the open looks first, the open decides)."""
        with self._lock:
            cached = self._entries.get(key)
            if cached is not None:
                self._entries.move_to_end(key)
                self.hits += 1
            elif count_miss:
                self.misses += 1
            return cached

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


_DEFAULT_CACHE = HeaderCache()
# A header read this quick came from the cache or a local page cache: the next one is read
# in line too (see open_checkpoint); anything slower goes to the storage, concurrently.


def read_header(path: str | os.PathLike[str], *, cache: HeaderCache | None = None) -> Header:
    """Read and validate one safetensors header (cached until the file changes)."""
    return (cache or _DEFAULT_CACHE).read(path)
