"""How a request's spans travel to the daemon: numbered, then as packed columns.

100k spans sent as one protobuf message per span cost about 200 ms to build in Python;
as packed repeated columns (file index, offset, length, stride, count, tensor index)
about 12 ms and 1 MB. So a request numbers its files (each absolute path once, in the
order its spans first name them) and its tensors (likewise, by checkpoint key), and
``WarmRequest`` carries one column per field; the daemon's events name tensors by
those numbers. Spans left out of a request (tensors resident already, files that would
not open) leave the tensor numbers as they are and renumber the files, so that no file
without a span is sent.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from spanwarm.checkpoint.tensor_layout import TensorSpans
from spanwarm.client.residency_check import distinct

__all__ = [
    "COLUMNS",
    "NumberedSpans",
    "SpanColumns",
    "drop_files",
    "message_dict",
    "select_spans",
    "span_bytes",
]

COLUMNS = ("file_index", "offset", "length", "stride", "count", "group_index")
"""WarmRequest's span columns, in the order :class:`SpanColumns` keeps them."""


@dataclass
class NumberedSpans:
    """A request's spans numbered by file and tensor, on the loader's thread: as plain
    lists, which is all a resident rank's request ever needs (:meth:`columns` builds the
    arrays once a request may go out)."""

    spans: Sequence[TensorSpans]
    files: list[str]
    """Absolute paths, each once, in the order the spans first name them."""
    tensors: list[str]
    """Checkpoint keys, each once, in the order the spans first name them."""
    nbytes: list[int]
    """Per tensor: the bytes of its spans."""
    file_index: list[int]
    group_index: list[int]
    envelopes: dict[tuple[int, int], list[int]]
    """(file, tensor) -> [first byte, end]: where its spans lie in that file."""

    @classmethod
    def of(cls, spans: Sequence[TensorSpans]) -> NumberedSpans:
        files: dict[str, int] = {}
        groups: dict[str, int] = {}
        nbytes: list[int] = []
        file_index: list[int] = []
        group_index: list[int] = []
        absolute: dict[str, int] = {}  # as given -> file number (a few files, many spans)
        envelopes: dict[tuple[int, int], list[int]] = {}
        for s in spans:
            f = absolute.get(s.path, -1)
            if f < 0:
                f = absolute[s.path] = files.setdefault(os.path.abspath(s.path), len(files))
            g = groups.setdefault(s.tensor, len(groups))
            if g == len(nbytes):
                nbytes.append(0)
            nbytes[g] += s.length * s.count
            file_index.append(f)
            group_index.append(g)
            end = s.offset + s.length
            if s.count > 1:
                end += (s.count - 1) * s.stride
            box = envelopes.get((f, g))
            if box is None:
                envelopes[(f, g)] = [s.offset, end]
            else:
                box[0] = min(box[0], s.offset)
                box[1] = max(box[1], end)
        return cls(spans, list(files), list(groups), nbytes, file_index, group_index, envelopes)

    def file_envelopes(self) -> list[tuple[list[int], list[int]]]:
        """Per file: the first bytes and the ends of its tensors' envelopes."""
        per_file: list[tuple[list[int], list[int]]] = [([], []) for _ in self.files]
        for (f, _), (first, end) in self.envelopes.items():
            per_file[f][0].append(first)
            per_file[f][1].append(end)
        return per_file

    def columns(self) -> SpanColumns:
        return SpanColumns.collect(self.files, self.file_index, self.group_index, self.spans)


@dataclass
class SpanColumns:
    """A request's spans as columns, named as WarmRequest's fields: what a request is
    built from on the ticket's thread, once the residency check has said which tensors
    to leave out."""

    files: list[str]
    file_index: Any
    offset: Any
    length: Any
    stride: Any
    count: Any
    group_index: Any

    @classmethod
    def collect(
        cls, files: list[str], file_index: list[int], group_index: list[int], spans: Any
    ) -> SpanColumns:
        """``spans``, numbered by file and tensor in ``file_index`` and ``group_index``."""
        return cls(
            files,
            np.asarray(file_index, dtype=np.int64),
            np.fromiter((s.offset for s in spans), dtype=np.int64, count=len(spans)),
            np.fromiter((s.length for s in spans), dtype=np.int64, count=len(spans)),
            np.fromiter((s.stride for s in spans), dtype=np.int64, count=len(spans)),
            np.fromiter((s.count for s in spans), dtype=np.int64, count=len(spans)),
            np.asarray(group_index, dtype=np.int64),
        )

    @classmethod
    def of(cls, request: Any) -> SpanColumns:
        """The span columns of ``request`` (a WarmRequest)."""
        columns = (np.asarray(getattr(request, name), dtype=np.int64) for name in COLUMNS)
        return cls(list(request.files), *columns)

    def kept(self, keep: Any) -> SpanColumns | None:
        """Only the spans where ``keep`` is set, and only the files those name
        (renumbered); None when no span is left. Tensors keep their numbers: the ticket's
        and the daemon's events name them so."""
        if keep.all():
            return self
        if not keep.any():
            return None
        file_index = self.file_index[keep]
        used = distinct(file_index)
        renumber = np.full(len(self.files), -1, dtype=np.int64)
        renumber[used] = np.arange(len(used))
        columns = (getattr(self, name)[keep] for name in COLUMNS[1:])
        return SpanColumns([self.files[i] for i in used.tolist()], renumber[file_index], *columns)

    def into(self, request: Any) -> Any:
        """``request`` (a WarmRequest) with these spans in place of its own."""
        del request.files[:]
        request.files.extend(self.files)
        for name in COLUMNS:
            del getattr(request, name)[:]
            getattr(request, name).extend(getattr(self, name).tolist())
        return request


def select_spans(request: Any, keep: Any) -> Any:
    """``request`` with only the spans where ``keep`` is set (see
    :meth:`SpanColumns.kept`); None when no span is left."""
    if keep.all():
        return request
    kept = SpanColumns.of(request).kept(keep)
    return None if kept is None else kept.into(request)


def drop_files(
    request: Any, failures: Mapping[int, str]
) -> tuple[Any, list[tuple[list[int], str]]]:
    """``request`` without the files at the positions ``failures`` names (their spans
    gone, the other files renumbered; None when no span is left), and for each such
    file the tensors with a byte in it, with its reason."""
    if not failures:
        return request, []
    file_index = np.asarray(request.file_index, dtype=np.int64)
    group_index = np.asarray(request.group_index, dtype=np.int64)
    dropped = [
        (distinct(group_index[file_index == position]).tolist(), reason)
        for position, reason in failures.items()
    ]
    return select_spans(request, ~np.isin(file_index, list(failures))), dropped


def span_bytes(request: Any) -> tuple[Any, Any, Any]:
    """Per span of ``request`` as sent: its file, its tensor, its bytes (float)."""
    nbytes = np.asarray(request.length, dtype=np.float64) * np.asarray(request.count)
    return (
        np.asarray(request.file_index, dtype=np.int64),
        np.asarray(request.group_index, dtype=np.int64),
        nbytes,
    )


def message_dict(message: Any) -> dict[str, Any]:
    """A protobuf message as plain Python values (numbers stay numbers, unlike MessageToDict)."""
    out: dict[str, Any] = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        nested = field.message_type is not None
        if field.is_repeated:
            out[field.name] = [message_dict(v) for v in value] if nested else list(value)
        else:
            out[field.name] = message_dict(value) if nested else value
    return out
