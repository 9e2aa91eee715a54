"""Where a tensor's elements live in a file: per-dim index runs -> strided byte spans.

safetensors stores tensors row-major and contiguous. A rank needs a box-like set of
global indices (a product of per-dim index runs, see :mod:`spanwarm.checkpoint.placements`); a file
may hold the whole tensor or one chunk of it (torch DCP records the chunk's global
offset). The needed runs are intersected with the chunk's region, then laid out:

- a dim followed by a fully-needed dim merges with it (its runs scale by that size), so
  what remains has every dim but the first partly needed;
- the last dim's runs are contiguous byte ranges, the one before it gives the row
  stride and count, and any dims further out are enumerated.

A ``Shard(1)`` slice of a ``[rows, cols]`` tensor is thus one strided span. Sub-byte
dtypes (F4, F6) are rounded outward to whole bytes, row by row when rows are not
byte-aligned.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from spanwarm.checkpoint.placements import IndexRuns
from spanwarm.checkpoint.safetensors_header import Header, TensorInfo
from spanwarm.checkpoint.spans import StridedSpan

__all__ = [
    "TensorSpans",
    "clip_runs",
    "global_shape",
    "piece_spans",
    "stored_tensor_spans",
    "tensor_spans",
]

RelativeSpans = tuple[tuple[int, int, int, int], ...]


def clip_runs(runs: IndexRuns, start: int, size: int) -> IndexRuns:
    """``runs`` restricted to ``[start, start + size)`` and shifted to start at 0."""
    stop = start + size
    return tuple(
        (max(a, start) - start, min(b, stop) - start) for a, b in runs if a < stop and b > start
    )


def _canonical(shape: Sequence[int], runs: Sequence[IndexRuns]) -> list[tuple[int, IndexRuns]]:
    """Merge every dim into the one before it when the later dim is fully needed."""
    dims: list[tuple[int, IndexRuns]] = []
    for size, dim_runs in reversed(list(zip(shape, runs, strict=True))):
        if dims and dims[0][1] == ((0, dims[0][0]),):
            inner = dims[0][0]
            dims[0] = (size * inner, tuple((a * inner, b * inner) for a, b in dim_runs))
        else:
            dims.insert(0, (size, dim_runs))
    return dims


def _indices(runs: IndexRuns) -> range | itertools.chain[int]:
    return itertools.chain.from_iterable(range(a, b) for a, b in runs)


@lru_cache(maxsize=65536)
def _relative_spans(
    shape: tuple[int, ...], bits: int, runs: tuple[IndexRuns, ...]
) -> RelativeSpans:
    """Spans as (byte offset from the tensor's first byte, length, stride, count)."""
    if any(not r for r in runs) or any(size == 0 for size in shape):
        return ()
    dims = _canonical(shape, runs) or [(1, ((0, 1),))]  # a scalar is one element
    strides = [1] * len(dims)
    for j in range(len(dims) - 2, -1, -1):
        strides[j] = strides[j + 1] * dims[j + 1][0]
    # (first element, elements per row, row stride in elements, rows)
    element_spans: list[tuple[int, int, int, int]] = []
    last_runs = dims[-1][1]
    if len(dims) == 1:
        element_spans = [(a, b - a, b - a, 1) for a, b in last_runs]
    else:
        row_stride = strides[-2]
        outer = [
            sum(i * s for i, s in zip(index, strides, strict=False))
            for index in itertools.product(*(_indices(r) for _, r in dims[:-2]))
        ]
        for base in outer:
            for p, q in dims[-2][1]:
                for a, b in last_runs:
                    element_spans.append((base + p * row_stride + a, b - a, row_stride, q - p))
    out: list[tuple[int, int, int, int]] = []
    for first, elements, stride, count in element_spans:
        if (stride * bits) % 8 == 0 or count == 1:
            start = first * bits // 8
            stop = -(-(first + elements) * bits // 8)
            out.append(
                (start, stop - start, stride * bits // 8 if count > 1 else stop - start, count)
            )
            continue
        for row in range(count):  # rows not byte-aligned: round each one outward
            row_first = first + row * stride
            start = row_first * bits // 8
            stop = -(-(row_first + elements) * bits // 8)
            out.append((start, stop - start, stop - start, 1))
    return tuple(out)


def tensor_spans(
    file_offset: int,
    shape: Sequence[int],
    dtype: str,
    needed: Sequence[IndexRuns] | None,
    *,
    global_offset: Sequence[int] | None = None,
) -> list[StridedSpan]:
    """Byte spans of the needed elements of a tensor (or chunk) stored at ``file_offset``.

    ``needed`` holds global index runs per dim (``None``: the whole tensor);
    ``global_offset`` is where the stored chunk starts in the global tensor.
    """
    shape = tuple(shape)
    offset = tuple(global_offset) if global_offset is not None else (0,) * len(shape)
    info = TensorInfo("", dtype, shape, 0, 0, offset)
    return [
        StridedSpan(file_offset + start, length, stride, count)
        for start, length, stride, count in piece_spans(info, needed)
    ]


@dataclass(frozen=True, slots=True)
class TensorSpans:
    """Bytes of checkpoint tensor ``tensor`` in ``path`` that a rank reads:
    ``[offset + i*stride, offset + i*stride + length)`` for ``i in range(count)``."""

    tensor: str
    path: str
    offset: int
    length: int
    stride: int
    count: int

    @property
    def span(self) -> StridedSpan:
        return StridedSpan(self.offset, self.length, self.stride, self.count)


def stored_tensor_spans(
    name: str,
    pieces: Sequence[tuple[Header, TensorInfo]],
    needed: Sequence[IndexRuns] | None,
) -> list[TensorSpans]:
    """Spans of the needed global indices of ``name`` across every stored piece of it."""
    out: list[TensorSpans] = []
    for header, info in pieces:
        offset = header.data_start + info.begin
        for start, length, stride, count in piece_spans(info, needed):
            out.append(TensorSpans(name, header.path, offset + start, length, stride, count))
    return out


def piece_spans(info: TensorInfo, needed: Sequence[IndexRuns] | None) -> RelativeSpans:
    """Spans of one stored piece as (offset from its first byte, length, stride, count)."""
    if needed is not None and len(needed) != len(info.shape):
        raise ValueError(
            f"tensor {info.name!r}: {len(needed)} dims of index runs for shape {list(info.shape)}"
        )
    return _piece_spans(
        info.shape, info.bits, info.global_offset, None if needed is None else tuple(needed)
    )


@lru_cache(maxsize=65536)
def _piece_spans(
    shape: tuple[int, ...], bits: int, offset: tuple[int, ...], needed: tuple[IndexRuns, ...] | None
) -> RelativeSpans:
    runs: tuple[IndexRuns, ...]
    if needed is None:
        runs = tuple(((0, size),) if size else () for size in shape)
    else:
        runs = tuple(clip_runs(r, o, s) for r, o, s in zip(needed, offset, shape, strict=True))
    return _relative_spans(shape, bits, runs)


def global_shape(pieces: Sequence[tuple[Header, TensorInfo]]) -> tuple[int, ...]:
    """The global shape covered by a tensor's stored pieces (one full tensor: its shape)."""
    if len(pieces) == 1 and not any(pieces[0][1].global_offset):
        return pieces[0][1].shape  # a tensor stored whole: the common case, per tensor
    shapes = [
        tuple(o + s for o, s in zip(t.global_offset, t.shape, strict=True)) for _, t in pieces
    ]
    return tuple(max(dims) for dims in zip(*shapes, strict=True)) if shapes[0] else ()
