"""Admitting a Warm request: validate it whole, open its files, or refuse it with a reason.

Every refusal is a :mod:`spanwarm.errors` type whose ``grpc_code`` the service answers
with, naming the file, the offset and the cause. Files are resolved (symlinks included)
before the allowed-roots check, must be regular files (a FIFO is stat'ed, never opened
for a blocking read), and are shared by identity across every request on the node.
"""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from spanwarm.daemon.config import DaemonConfig
from spanwarm.errors import (
    FileChangedError,
    InvalidRequestError,
    NotARegularFileError,
    PathNotAllowedError,
    RequestTooLargeError,
    ShardMissingError,
    SpanOutOfRangeError,
)
from spanwarm.residency import residency_trusted
from spanwarm.spans import SpanTable

__all__ = ["AdmittedRequest", "FileIdentity", "FileTable", "OpenFile", "admit"]

_MAX_VALUE = 2**62  # span arithmetic stays inside int64


@dataclass(frozen=True, slots=True)
class FileIdentity:
    device: int
    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileIdentity:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class OpenFile:
    """A file some live request needs, open once for the whole node."""

    def __init__(self, path: str, fd: int, identity: FileIdentity) -> None:
        self.path = path
        self.fd = fd
        self.identity = identity
        self.trusted = residency_trusted(fd)  # mincore tells the truth for this file
        self.refs = 0

    @property
    def size(self) -> int:
        return self.identity.size

    @contextmanager
    def stream(self) -> Iterator[int]:
        """A fresh descriptor for one warm operation, checked to be the same file.

        One open file description per operation is one stream to the storage: its own
        readahead state, and on a network mount its own connection-level sequential
        read, instead of eight workers interleaving on one handle (every read a seek).
        """
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            raise FileChangedError(self.path, "was removed while warming") from None
        try:
            now = FileIdentity.of(os.fstat(fd))
            if now != self.identity:
                raise FileChangedError(
                    self.path, f"changed while warming ({self.identity} -> {now})"
                )
            # Read exactly the planned ranges: kernel readahead would warm neighbours nobody
            # asked for (+57% bytes for 64 KiB spans, research/machine-probes.md 2.3).
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            yield fd
        finally:
            os.close(fd)


class FileTable:
    """Open files by identity, reference-counted by the requests that use them.

    Thread-safe: requests are admitted in worker threads (stat and open may block on a
    network mount) while the event loop releases them.
    """

    def __init__(self, allow: tuple[str, ...]) -> None:
        self._roots = tuple(os.path.realpath(root) for root in allow)
        self._files: dict[FileIdentity, OpenFile] = {}
        self._lock = threading.Lock()

    def acquire(self, path: str) -> OpenFile:
        if not path or not os.path.isabs(path):
            raise InvalidRequestError(f"file {path!r}: paths must be absolute")
        real = os.path.realpath(path)
        if self._roots and not any(
            os.path.commonpath([real, root]) == root for root in self._roots
        ):
            raise PathNotAllowedError(
                path, f"resolves to {real}, outside the allowed roots {list(self._roots)}"
            )
        try:
            st = os.stat(real)
        except FileNotFoundError:
            raise ShardMissingError(path, "no such file") from None
        except PermissionError as exc:
            raise PathNotAllowedError(
                path, f"cannot be read by the daemon: {exc.strerror}"
            ) from None
        if not stat.S_ISREG(st.st_mode):
            raise NotARegularFileError(path, "is not a regular file")
        identity = FileIdentity.of(st)
        with self._lock:
            shared = self._files.get(identity)
            if shared is not None:
                shared.refs += 1
                return shared
        try:
            fd = os.open(real, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except PermissionError as exc:
            raise PathNotAllowedError(
                path, f"cannot be read by the daemon: {exc.strerror}"
            ) from None
        opened = FileIdentity.of(os.fstat(fd))
        if opened != identity:
            os.close(fd)
            raise FileChangedError(path, "changed while being opened")
        with self._lock:
            shared = self._files.get(identity)  # opened meanwhile by another request
            if shared is not None:
                os.close(fd)
                shared.refs += 1
                return shared
            file = OpenFile(real, fd, identity)
            file.refs = 1
            self._files[identity] = file
            return file

    def release(self, file: OpenFile) -> None:
        with self._lock:
            file.refs -= 1
            if file.refs == 0:
                del self._files[file.identity]
                os.close(file.fd)

    def close_all(self) -> None:
        with self._lock:
            for file in self._files.values():
                os.close(file.fd)
            self._files.clear()

    def __len__(self) -> int:
        return len(self._files)


@dataclass
class AdmittedRequest:
    """A validated request: its files opened, its spans as columns per file."""

    job: str
    rank: int
    files: list[OpenFile]
    groups: list[str]
    spans: dict[int, SpanTable]  # file position -> spans, in request order
    span_groups: dict[int, npt.NDArray[np.int64]]  # file position -> group of each span
    group_order: npt.NDArray[np.int64]  # first span index of each group (request order)

    @property
    def nbytes(self) -> int:
        return sum(int((t.length * t.count).sum()) for t in self.spans.values())


def _column(values: Any, name: str) -> npt.NDArray[np.int64]:
    # fromiter: one Python int at a time, not a list of a million of them (RSS stays flat).
    array = np.fromiter(values, dtype=np.uint64, count=len(values))
    if array.size and int(array.max()) >= _MAX_VALUE:
        raise InvalidRequestError(f"{name}: a value is beyond 2**62")
    return array.astype(np.int64)


def admit(request: Any, table: FileTable, config: DaemonConfig) -> AdmittedRequest:
    """Validate a ``spanwarm.v1.WarmRequest`` and open its files, or raise why not."""
    columns = ("file_index", "offset", "length", "stride", "count", "group_index")
    n = len(request.offset)
    if any(len(getattr(request, c)) != n for c in columns):
        lengths = {c: len(getattr(request, c)) for c in columns}
        raise InvalidRequestError(f"span columns differ in length: {lengths}")
    if n > config.max_spans:
        raise RequestTooLargeError(f"{n} spans exceed the limit of {config.max_spans} per request")
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
    if n and int(count.max()) * max(int(stride.max()), 1) >= _MAX_VALUE:
        raise InvalidRequestError("stride x count is beyond 2**62")

    files: list[OpenFile] = []
    try:
        for path in request.files:  # one by one: a refusal releases what was acquired
            files.append(table.acquire(path))  # noqa: PERF401
        spans: dict[int, SpanTable] = {}
        span_groups: dict[int, npt.NDArray[np.int64]] = {}
        for position, file in enumerate(files):
            mine = file_index == position
            t = SpanTable(offset[mine], length[mine], stride[mine], count[mine])
            ends = np.where(t.count > 0, t.envelope_stops(), t.offset)
            beyond = np.flatnonzero(ends > file.size)
            if beyond.size:
                i = int(beyond[0])
                raise SpanOutOfRangeError(
                    request.files[position],
                    f"span ends at {int(ends[i])}, past the end of the {file.size}-byte file",
                    offset=int(t.offset[i]),
                )
            spans[position] = t
            span_groups[position] = group_index[mine]
    except Exception:
        for file in files:
            table.release(file)
        raise
    first_span = np.full(len(request.groups), n, dtype=np.int64)
    np.minimum.at(first_span, group_index, np.arange(n, dtype=np.int64))
    return AdmittedRequest(
        job=request.job,
        rank=request.rank,
        files=files,
        groups=list(request.groups),
        spans=spans,
        span_groups=span_groups,
        group_order=first_span,
    )
