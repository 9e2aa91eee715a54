"""The page a safetensors slice touches beyond the rows it copies.

safetensors' ``get_slice(name)[box]`` (0.8) returns a view into the file's mapping whose
storage is the whole stored tensor, and making it reads the tensor's first byte: the page
holding it is faulted in whatever rows the box names, with the mount's read-around
(8 MiB on this VM's disk, 256 KiB on a FUSE mount), before the rows themselves are
copied. A rank that holds no first rows of a tensor (TP ranks past the first, EP ranks
past the first expert) would read that page cold after the daemon said the tensor was
ready: a round trip per tensor on a slow mount, in the loader's path. transformers and
torch DCP's safetensors readers both slice so.

A slice with no elements does so too: transformers slices a tensor whose dimension is
smaller than its mesh (FSDP4 over a [2, 384] embedding) for nothing on the ranks past
it, and that read is a cold page as well.

A request for such a load names that page too, as a span of the tensor: warmed with it,
counted in its bytes, and found resident by the rank before it reads.
:func:`~spanwarm.client.rank_spans.rank_spans` stays what the loader copies (the read
oracle compares it) unless asked for the pages (``first_pages=True``); only the request
grows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from spanwarm.checkpoint.resolve import Checkpoint
from spanwarm.checkpoint.safetensors_header import Header, TensorInfo
from spanwarm.checkpoint.tensor_layout import TensorSpans
from spanwarm.pagecache.residency import PAGE

__all__ = ["first_page_span", "tensor_first_pages", "with_first_pages"]

Pieces = Sequence[tuple[Header, TensorInfo]]


def with_first_pages(spans: Sequence[TensorSpans], checkpoint: Checkpoint) -> list[TensorSpans]:
    """``spans`` of a sliced safetensors load, with the first page of each stored piece
    they read (a span of its bytes there, before the piece's first span) wherever no span
    of that tensor in that file reaches into that page already."""
    return _with_first_pages(spans, checkpoint.pieces)


def tensor_first_pages(tensor: str, pieces: Pieces, spans: list[TensorSpans]) -> list[TensorSpans]:
    """:func:`with_first_pages` of one tensor's ``spans`` (stored as ``pieces``), where a
    slice of it with no elements (``spans`` empty) faults in the first page of its one
    stored piece (and of none where it is stored in pieces: an empty box overlaps none of
    them, and a loader slices only those its box does)."""
    if len(pieces) != 1:
        return _with_first_pages(spans, {tensor: pieces}) if spans else []
    lowest = min(s.offset for s in spans) if spans else None  # every span is in its file
    touch = _first_page(tensor, pieces[0][0].path, lowest, pieces)
    return spans if touch is None else [touch, *spans]


def _with_first_pages(
    spans: Sequence[TensorSpans], pieces: Mapping[str, Pieces]
) -> list[TensorSpans]:
    first: dict[tuple[str, str], int] = {}  # (tensor, path) -> its lowest span offset
    for s in spans:
        key = (s.tensor, s.path)
        offset = first.get(key)
        if offset is None or s.offset < offset:
            first[key] = s.offset
    out: list[TensorSpans] = []
    for s in spans:
        key = (s.tensor, s.path)
        lowest = first.pop(key, None)
        if lowest is not None:
            touch = _first_page(s.tensor, s.path, lowest, pieces.get(s.tensor, ()))
            if touch is not None:
                out.append(touch)
        out.append(s)
    return out


def _first_page(tensor: str, path: str, lowest: int | None, pieces: Pieces) -> TensorSpans | None:
    """:func:`first_page_span` of ``tensor``'s piece in ``path`` (None: not known there)."""
    for header, info in pieces:
        if header.path == path:
            begin = header.file_offset(info)
            return first_page_span(tensor, path, begin, header.data_start + info.end, lowest)
    return None


def first_page_span(
    group: str, path: str, begin: int, end: int, lowest: int | None
) -> TensorSpans | None:
    """The bytes of a stored tensor (``[begin, end)`` of ``path``) in the page of its first
    byte, as a span of ``group``; None where the group's lowest span (at ``lowest``; None:
    it has none) starts in that page already, or the tensor has no bytes."""
    page_end = begin - begin % PAGE + PAGE
    if (lowest is not None and lowest < page_end) or end <= begin:
        return None
    stop = min(page_end, end)
    return TensorSpans(group, path, begin, stop - begin, stop - begin, 1)
