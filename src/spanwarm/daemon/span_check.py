"""Checking a Warm request before any of its files is touched: its span columns decoded,
brought to their normal form, and held to the per-request limits.

Pure work on bytes and arrays (no descriptor, no file, no lock), so that a large request's
share of it runs in a helper process (:mod:`.helpers`) instead of under the daemon's GIL.
A refusal is an :class:`~spanwarm.errors.InvalidRequestError` or
:class:`~spanwarm.errors.RequestTooLargeError` naming the span and the value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
from google.protobuf.message import DecodeError

from spanwarm.daemon.config import DaemonConfig
from spanwarm.errors import InvalidRequestError, RequestTooLargeError
from spanwarm.rpc.v1 import warmer_pb2

__all__ = ["CheckedRequest", "check_request", "decode_and_check", "decode_message"]

_MAX_VALUE = 2**62  # every wire value is below this, so span arithmetic stays inside int64
_MAX_NAMED = 2**60  # bytes one request may name in total (sums stay exact in int64)


@dataclass
class CheckedRequest:
    """A Warm request whose spans passed every check that needs no file: columns in their
    normal form (see :class:`~spanwarm.daemon.admission.AdmittedRequest`), ``end`` where
    each span ends, every value below 2**62."""

    job: str
    rank: int
    token: str
    paths: list[str]
    groups: list[str]
    file_index: npt.NDArray[np.int64]
    group_index: npt.NDArray[np.int64]
    offset: npt.NDArray[np.int64]
    length: npt.NDArray[np.int64]
    stride: npt.NDArray[np.int64]
    count: npt.NDArray[np.int64]
    end: npt.NDArray[np.int64]


def decode_message(cls: Any, data: bytes) -> Any:
    """``data`` as a message of type ``cls``, or InvalidRequestError saying why not."""
    try:
        return cls.FromString(data)
    except (DecodeError, ValueError) as exc:
        raise InvalidRequestError(f"not a valid {cls.DESCRIPTOR.name}: {exc}") from None


def decode_and_check(data: bytes, config: DaemonConfig) -> CheckedRequest:
    """A serialized ``spanwarm.v1.WarmRequest``, decoded and checked (runs in a helper)."""
    return check_request(decode_message(warmer_pb2.WarmRequest, data), config)


def _column(values: Any, name: str) -> npt.NDArray[np.int64]:
    # fromiter: one Python int at a time, not a list of a million of them (RSS stays flat).
    array = np.fromiter(values, dtype=np.uint64, count=len(values))
    if array.size and int(array.max()) >= _MAX_VALUE:
        i = int(np.argmax(array >= _MAX_VALUE))
        raise InvalidRequestError(f"{name}[{i}] = {int(array[i])} is beyond 2**62")
    return array.astype(np.int64)


def _normalize(
    offset: npt.NDArray[np.int64],
    length: npt.NDArray[np.int64],
    stride: npt.NDArray[np.int64],
    count: npt.NDArray[np.int64],
) -> npt.NDArray[np.int64]:
    """Rewrite the span columns in place to their normal form (see AdmittedRequest) and
    return where each span ends. Every value is below 2**62 on entry; nothing overflows:
    the last row's start is checked by division before it is computed."""
    empty = (length == 0) | (count == 0)
    offset[empty], length[empty], stride[empty], count[empty] = 0, 0, 1, 0
    count[(count > 1) & (stride == 0)] = 1  # the same row again names no new byte
    rows = count > 1
    room = _MAX_VALUE - offset[rows] - length[rows]  # > -2**62: no overflow
    beyond = (count[rows] - 1) > room // stride[rows]
    if beyond.any():
        i = int(np.flatnonzero(rows)[np.argmax(beyond)])
        raise InvalidRequestError(
            f"span {i}: offset {int(offset[i])} + (count {int(count[i])} - 1) x stride "
            f"{int(stride[i])} + length {int(length[i])} is beyond 2**62"
        )
    touching = rows & (length >= stride)  # rows that meet or overlap: one contiguous run
    length[touching] = (count[touching] - 1) * stride[touching] + length[touching]
    count[touching] = 1
    single = count == 1
    stride[single] = np.maximum(length[single], 1)
    return offset + (count - 1) * stride + length


def _over(values: npt.NDArray[np.int64], limit: int) -> int:
    """``values.sum()`` when it is at most about twice ``limit``, else ``limit + 1``; exact
    where it matters and free of overflow (limits are at most 2**40, see DaemonConfig)."""
    clipped = np.minimum(values, limit + 1)
    if float(clipped.sum(dtype=np.float64)) > 2 * limit + 2:  # far over: rounding is moot
        return limit + 1
    return int(clipped.sum())


def _check_work(
    file_index: npt.NDArray[np.int64],
    offset: npt.NDArray[np.int64],
    end: npt.NDArray[np.int64],
    length: npt.NDArray[np.int64],
    count: npt.NDArray[np.int64],
    config: DaemonConfig,
) -> None:
    """Refuse a request whose bookkeeping would cost more than the limits allow, before
    any of it is built: what the daemon allocates follows the cells and rows the spans
    touch, not the number of spans (128 strided spans can touch 8 million cells)."""
    if (length * count).sum(dtype=np.float64) >= _MAX_NAMED:  # each term <= its file's size
        raise InvalidRequestError("the spans name more than 2**60 bytes in total")
    live = count > 0
    chunk = config.chunk_bytes
    first, last = offset[live] // chunk, (end[live] - 1) // chunk
    per_span = last - first + 1
    if _over(per_span, config.max_span_cells) > config.max_span_cells:
        raise RequestTooLargeError(
            f"the spans touch more than {config.max_span_cells} cells of {chunk} bytes, "
            "counting each span's cells between its first and last byte (max_span_cells)"
        )
    # Distinct cells, bounded per file by the lesser of its spans' cells and its envelope.
    files = file_index[live]
    order = np.argsort(files, kind="stable")
    heads = np.flatnonzero(np.diff(files[order], prepend=-1))
    if heads.size:
        envelope = (
            np.maximum.reduceat(last[order], heads) - np.minimum.reduceat(first[order], heads) + 1
        )
        distinct = np.minimum(envelope, np.add.reduceat(per_span[order], heads))
        if _over(distinct, config.max_cells) > config.max_cells:
            raise RequestTooLargeError(
                f"the spans touch more than {config.max_cells} distinct cells of {chunk} bytes "
                "(max_cells)"
            )
    if _over(np.where(count > 1, count, 0), config.max_rows) > config.max_rows:
        raise RequestTooLargeError(
            f"the strided spans have more than {config.max_rows} rows in total (max_rows)"
        )


def check_request(request: Any, config: DaemonConfig) -> CheckedRequest:
    """Check a decoded ``spanwarm.v1.WarmRequest`` against everything but its files, in
    exact arithmetic, or raise why not."""
    columns = ("file_index", "offset", "length", "stride", "count", "group_index")
    n = len(request.offset)
    if any(len(getattr(request, c)) != n for c in columns):
        lengths = {c: len(getattr(request, c)) for c in columns}
        raise InvalidRequestError(f"span columns differ in length: {lengths}")
    if n > config.max_spans:
        raise RequestTooLargeError(f"{n} spans exceed the limit of {config.max_spans} per request")
    if len(request.groups) > config.max_spans:
        raise RequestTooLargeError(
            f"{len(request.groups)} groups exceed the limit of {config.max_spans} per request"
        )
    if len(request.files) > config.max_files:
        raise RequestTooLargeError(
            f"{len(request.files)} files exceed the limit of {config.max_files} per request"
        )
    file_index = _column(request.file_index, "file_index")
    group_index = _column(request.group_index, "group_index")
    if n and int(file_index.max()) >= len(request.files):
        raise InvalidRequestError(
            f"file_index {int(file_index.max())} outside {len(request.files)} files"
        )
    if n and int(group_index.max()) >= len(request.groups):
        raise InvalidRequestError(
            f"group_index {int(group_index.max())} outside {len(request.groups)} groups"
        )
    offset, length = _column(request.offset, "offset"), _column(request.length, "length")
    stride, count = _column(request.stride, "stride"), _column(request.count, "count")
    end = _normalize(offset, length, stride, count)
    _check_work(file_index, offset, end, length, count, config)
    return CheckedRequest(
        job=request.job,
        rank=request.rank,
        token=request.token,
        paths=list(request.files),
        groups=list(request.groups),
        file_index=file_index,
        group_index=group_index,
        offset=offset,
        length=length,
        stride=stride,
        count=count,
        end=end,
    )
