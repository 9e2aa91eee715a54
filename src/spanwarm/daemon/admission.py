"""Admitting a Warm request whose spans passed :mod:`.span_check`: take its files (the
node's file table, :mod:`.files`), or refuse it with a reason.

Every refusal is a :mod:`spanwarm.errors` type whose ``grpc_code`` the service answers
with, naming the file, the offset and the cause. A request's files come as descriptors
its caller opened (a grant, :mod:`spanwarm.daemon.access`); the daemon opens a path by
name only for its own user (:meth:`.files.FileTable.acquire`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from spanwarm.checkpoint.spans import SpanTable
from spanwarm.daemon.files import Adopted, FileTable, OpenFile
from spanwarm.daemon.span_check import CheckedRequest
from spanwarm.errors import InvalidRequestError, SpanOutOfRangeError

__all__ = ["AdmittedRequest", "admit"]


@dataclass
class AdmittedRequest:
    """A validated request: its files opened, its spans as columns per file.

    Spans are normalized: rows that touch or overlap (``length >= stride``) are one
    contiguous span, a zero stride names its row once, and spans naming no bytes are
    ``(0, 0, 1, 0)``. So ``length * count`` is exactly the bytes a span names.
    """

    job: str
    rank: int
    files: list[OpenFile]
    names: list[str]  # the kernel's name for each file as the caller opened it
    groups: list[str]
    spans: dict[int, SpanTable]  # file position -> spans, in request order
    span_groups: dict[int, npt.NDArray[np.int64]]  # file position -> group of each span

    @property
    def nbytes(self) -> int:
        return sum(int((t.length * t.count).sum()) for t in self.spans.values())


def admit(
    request: CheckedRequest,
    table: FileTable,
    granted: list[Adopted] | None = None,
) -> AdmittedRequest:
    """Take the files of a checked request (:mod:`.span_check`), or raise why not.

    ``granted``: the files of the request's grant (and the caller's name for each), one
    per path of the request
    (their references pass to the request, or are given back on a refusal); None opens
    the paths by name (the daemon's own user only). A refusal gives back every file
    already taken.
    """
    files = [] if granted is None else list(granted)
    try:
        return _admit(request, table, files, by_name=granted is None)
    except BaseException:
        for file, _ in files:
            table.release(file)
        raise


def _admit(
    request: CheckedRequest,
    table: FileTable,
    files: list[Adopted],
    *,
    by_name: bool,
) -> AdmittedRequest:
    """``admit`` with ``files``: the granted files, or the list the files opened by name go
    into (the caller releases whatever it holds on a refusal)."""
    if not by_name and len(files) != len(request.paths):
        raise InvalidRequestError(
            f"the request names {len(request.paths)} files, its grant {len(files)} descriptors"
        )
    if by_name:
        for path in request.paths:  # one by one: a refusal releases what was acquired
            files.append(table.acquire(path))  # noqa: PERF401
    file_index, count, end = request.file_index, request.count, request.end
    spans: dict[int, SpanTable] = {}
    span_groups: dict[int, npt.NDArray[np.int64]] = {}
    for position, (file, name) in enumerate(files):
        mine = file_index == position
        beyond = np.flatnonzero(mine & (count > 0) & (end > file.size))
        if beyond.size:
            i = int(beyond[0])
            raise SpanOutOfRangeError(
                name,  # the kernel's name for the caller's descriptor, never its label
                f"span {i} ends at {int(end[i])}, past the end of the {file.size}-byte file",
                offset=int(request.offset[i]),
            )
        spans[position] = SpanTable(
            request.offset[mine], request.length[mine], request.stride[mine], count[mine]
        )
        span_groups[position] = request.group_index[mine]
    return AdmittedRequest(
        job=request.job,
        rank=request.rank,
        files=[f for f, _ in files],
        names=[name for _, name in files],
        groups=request.groups,
        spans=spans,
        span_groups=span_groups,
    )
