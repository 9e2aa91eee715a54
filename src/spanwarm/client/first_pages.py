"""The page a safetensors slice touches beyond the rows it copies.

safetensors' ``get_slice(name)[box]`` (0.8) returns a view into the file's mapping whose
storage is the whole stored tensor, and making it reads the tensor's first byte: the page
holding it is faulted in whatever rows the box names, with the mount's read-around
(8 MiB on this VM's disk, 256 KiB on a FUSE mount), before the rows themselves are
copied. A rank that holds no first rows of a tensor (TP ranks past the first, EP ranks
past the first expert) would read that page cold after the daemon said the tensor was
ready: a round trip per tensor on a slow mount, in the loader's path. transformers and
torch DCP's safetensors readers both slice so.

A request for such a load names that page too, as a span of the tensor: warmed with it,
counted in its bytes, and found resident by the rank before it reads. :func:`rank_spans`
stays what the loader copies (the read oracle compares it); only the request grows.
"""

from __future__ import annotations

from collections.abc import Sequence

from spanwarm.residency import PAGE
from spanwarm.safetensors_header import Checkpoint
from spanwarm.tensor_layout import TensorSpans

__all__ = ["first_page_span", "with_first_pages"]


def with_first_pages(spans: Sequence[TensorSpans], checkpoint: Checkpoint) -> list[TensorSpans]:
    """``spans`` of a sliced safetensors load, with the first page of each stored piece
    they read (a span of its bytes there, before the piece's first span) wherever no span
    of that tensor in that file reaches into that page already."""
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
            touch = _first_page(s.tensor, s.path, lowest, checkpoint)
            if touch is not None:
                out.append(touch)
        out.append(s)
    return out


def _first_page(tensor: str, path: str, lowest: int, checkpoint: Checkpoint) -> TensorSpans | None:
    """:func:`first_page_span` of ``tensor``'s piece in ``path`` (None: not known there)."""
    for header, info in checkpoint.pieces.get(tensor, ()):
        if header.path == path:
            begin = header.file_offset(info)
            return first_page_span(tensor, path, begin, header.data_start + info.end, lowest)
    return None


def first_page_span(group: str, path: str, begin: int, end: int, lowest: int) -> TensorSpans | None:
    """The bytes of a stored tensor (``[begin, end)`` of ``path``) in the page of its first
    byte, as a span of ``group``; None where the group's lowest span (at ``lowest``)
    starts in that page already."""
    page_end = begin - begin % PAGE + PAGE
    if lowest < page_end:
        return None
    stop = min(page_end, end)
    return TensorSpans(group, path, begin, stop - begin, stop - begin, 1)
