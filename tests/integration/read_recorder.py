"""Record what a loader reads of safetensors files, independently of spanwarm's span code.

``safe_open`` is replaced by :class:`RecordingFile`: every slice it hands out logs the
index the loader reads it with, and ``get_tensor`` logs the whole tensor. The indices
become byte ranges here with numpy and the file's own header. ``reads`` maps each file
to its ``(start, stop)`` byte ranges; ``read_order`` lists tensors by first read.
``touched`` maps each file to the bytes a slice faults in besides those: safetensors 0.8
views the whole stored tensor and reads its first byte, so each sliced tensor's first
page (its bytes there) is read whatever the index, an empty one too.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from typing import Any

import numpy as np
from safetensors import safe_open

__all__ = ["RecordingFile", "read_order", "reads", "touched"]

_ITEMSIZE = {
    **{"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "I8": 1, "U8": 1},
    **{"F8_E4M3": 1, "F8_E5M2": 1, "BOOL": 1},
}
reads: dict[str, list[tuple[int, int]]] = {}
touched: dict[str, list[tuple[int, int]]] = {}
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
        self.end = data_start + entry["data_offsets"][1]

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
        if self.end > self.base:  # an empty index too: the view reads the first byte
            page_end = self.base - self.base % mmap.PAGESIZE + mmap.PAGESIZE
            touched.setdefault(self.path, []).append((self.base, min(page_end, self.end)))
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
    def __init__(self, filename: str, *args: Any, **kwargs: Any) -> None:
        self.inner = safe_open(filename, *args, **kwargs)
        self.path = os.path.abspath(filename)

    def get_slice(self, name: str) -> RecordingSlice:
        return RecordingSlice(self.inner.get_slice(name), self.path, name)  # type: ignore[no-untyped-call]

    def get_tensor(self, name: str) -> Any:
        return self.get_slice(name)[...]

    def __enter__(self) -> RecordingFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.inner.__exit__(*exc)  # type: ignore[no-untyped-call]

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.inner, attr)
