"""The bytes a torch DCP storage reader reads for a load plan, item by item, in its order.

A rank's final local load plan lists ``ReadItem``s: a stored chunk (``storage_index``, a
key of the reader's ``storage_data``) and the box of it to copy (``storage_offsets``,
``lengths``, relative to the chunk). What each reader then reads (torch 2.13):

- ``FileSystemReader``, DCP's native format (``.distcp`` files and ``.metadata``): the
  chunk is ``_StorageInfo(relative_path, offset, length)``; ``torch.load`` reads that
  whole slice of ``path/relative_path``, and the box is cut out in memory. Items of one
  chunk share its bytes.
- ``HuggingFaceStorageReader``: the chunk is the tensor named ``fqn`` in the file
  ``_HFStorageInfo.relative_path``; ``safe_open(...).get_slice(fqn)[box]`` reads exactly
  the box's elements (the safetensors header says where the tensor starts), and the page
  of the tensor's first byte (:mod:`spanwarm.client.first_pages`).
- ``QuantizedHuggingFaceStorageReader``: the same, and for a weight with a scale (its
  ``_weight_scale_mapping``) the whole scale tensor, from the weight's file or from the
  one the index names; an MXFP4 ``_blocks`` box widens to whole groups of dim 2.

Files are read one after another in the order of their first item, items in plan order
within a file (the HF readers with ``thread_count > 1`` read several files at once, in
that order). A reader that reads some other way (a subclass overriding how, a remote
``fsspec`` file system) is not understood: :func:`plan_reads` returns None, and the load
goes on without prefetch.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from spanwarm.checkpoint.safetensors_header import Header, TensorInfo, read_header
from spanwarm.checkpoint.tensor_layout import TensorSpans, tensor_spans
from spanwarm.client.first_pages import tensor_first_pages
from spanwarm.errors import CheckpointError

__all__ = ["PlanReads", "chunk_name", "item_name", "plan_reads", "reader_kind"]

logger = logging.getLogger("spanwarm.dcp")


def chunk_name(index: Any) -> str:
    """The name of one stored chunk (a ``MetadataIndex``): ``fqn@[offsets]``."""
    offset = getattr(index, "offset", None)
    return index.fqn if offset is None else f"{index.fqn}@{list(offset)}"


def item_name(item: Any) -> str:
    """The name of what one ``ReadItem`` reads of its chunk: ``fqn@[offsets][a:b,...]``."""
    box = ",".join(f"{o}:{o + n}" for o, n in zip(item.storage_offsets, item.lengths, strict=True))
    return f"{chunk_name(item.storage_index)}[{box}]"


def reader_kind(reader: Any) -> str | None:
    """``"native"``, ``"safetensors"`` or ``"quantized"``; None for a reader whose reads
    are not known here (its class or the instance overrides how it reads, or its files are
    not local)."""
    from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader
    from torch.distributed.checkpoint.quantized_hf_storage import (
        QuantizedHuggingFaceStorageReader,
    )

    cls = type(reader)
    if not isinstance(getattr(reader, "fs", None), FileSystem):
        return None  # fsspec and friends: the daemon warms local files only
    if {"read_data", "_process_read_request", "_slice_file"} & vars(reader).keys():
        return None  # this instance reads its own way (or a load of it is being gated)
    if isinstance(reader, QuantizedHuggingFaceStorageReader):
        same = (
            cls.read_data is HuggingFaceStorageReader.read_data
            and cls._process_read_request is QuantizedHuggingFaceStorageReader._process_read_request
            and cls._read_quantized_tensor_with_block_alignment
            is QuantizedHuggingFaceStorageReader._read_quantized_tensor_with_block_alignment
        )
        return "quantized" if same else None
    if isinstance(reader, HuggingFaceStorageReader):
        same = (
            cls.read_data is HuggingFaceStorageReader.read_data
            and cls._process_read_request is HuggingFaceStorageReader._process_read_request
        )
        return "safetensors" if same else None
    if isinstance(reader, FileSystemReader):
        same = (
            cls.read_data is FileSystemReader.read_data
            and cls._slice_file is FileSystemReader._slice_file
        )
        return "native" if same else None
    return None


@dataclass
class PlanReads:
    """What one rank's load reads, as spans grouped per waitable unit, in read order.

    ``native``: one group per stored chunk (every item of it waits for the whole chunk,
    which ``torch.load`` reads whole); the HF readers: one group per item.
    """

    kind: str
    spans: list[TensorSpans]
    skipped: int = 0
    """Items whose bytes could not be located (the reader will fail on them itself)."""


def _by_file(reader: Any, items: Sequence[Any]) -> dict[str, list[Any]]:
    """Items grouped by the file the reader opens for them, in its order."""
    per_file: dict[str, list[Any]] = {}
    for item in items:
        path = reader.storage_data[item.storage_index].relative_path
        if not isinstance(path, str):
            path = os.fspath(path)
        per_file.setdefault(path, []).append(item)
    return per_file


def _native(reader: Any, per_file: dict[str, list[Any]]) -> PlanReads:
    out = PlanReads("native", [])
    for relative, items in per_file.items():
        path = os.path.abspath(os.fspath(reader.fs.concat_path(reader.path, relative)))
        seen: set[str] = set()
        for item in items:
            name = chunk_name(item.storage_index)
            if name in seen:
                continue
            seen.add(name)
            info = reader.storage_data[item.storage_index]
            offset, length = int(info.offset), int(info.length)
            if offset < 0 or length < 0:
                out.skipped += 1
                continue
            if length:
                out.spans.append(TensorSpans(name, path, offset, length, length, 1))
    return out


def _headers(paths: Sequence[str]) -> dict[str, Header | CheckpointError]:
    """Each file's validated header (cached), read concurrently: on a network mount each
    is a round trip. A file that fails validation maps to its error."""

    def read(path: str) -> Header | CheckpointError:
        try:
            return read_header(path)
        except CheckpointError as exc:
            return exc

    with ThreadPoolExecutor(max_workers=max(1, min(16, len(paths)))) as pool:
        return dict(zip(paths, pool.map(read, paths), strict=True))


class _Files:
    """Validated headers of the files a plan reads, and their tensors by name (a file may
    hold a chunk of every tensor of a model: one dict, not a scan per item)."""

    def __init__(self, paths: Sequence[str]) -> None:
        self.headers: dict[str, Header | CheckpointError] = _headers(paths)
        self._by_name: dict[str, dict[str, TensorInfo]] = {}

    def tensor(self, path: str, name: str) -> tuple[Header, TensorInfo] | None:
        if path not in self.headers:
            self.headers.update(_headers([path]))
        header = self.headers[path]
        if isinstance(header, CheckpointError):
            return None
        if path not in self._by_name:
            self._by_name[path] = {t.name: t for t in header.tensors}
        tensor = self._by_name[path].get(name)
        return None if tensor is None else (header, tensor)


def _box_spans(
    group: str, header: Header, tensor: TensorInfo, box: Sequence[tuple[int, int]] | None
) -> list[TensorSpans]:
    """Spans of ``box`` (per dim ``(start, stop)`` in the stored tensor; None: all of it)."""
    if box is not None and (
        len(box) != len(tensor.shape)
        or any(not 0 <= a <= b <= n for (a, b), n in zip(box, tensor.shape, strict=False))
    ):
        raise ValueError(f"box {box} is outside {tensor.name} of shape {list(tensor.shape)}")
    needed = None if box is None else tuple(((a, b),) if b > a else () for a, b in box)
    return [
        TensorSpans(group, header.path, s.offset, s.length, s.stride, s.count)
        for s in tensor_spans(header.file_offset(tensor), tensor.shape, tensor.dtype, needed)
    ]


def _scale_spans(reader: Any, group: str, fqn: str, path: str, files: _Files) -> list[TensorSpans]:
    """The whole scale tensor the quantized reader reads with weight ``fqn``."""
    scale = reader._weight_scale_mapping[fqn]
    scale_file = reader._weight_map.get(scale)
    if scale_file is None:
        return []
    if scale_file != reader._weight_map.get(fqn):
        path = os.path.join(os.fspath(reader.path), scale_file)
    found = files.tensor(path, scale)
    return [] if found is None else _box_spans(group, *found, None)


def _safetensors(reader: Any, kind: str, per_file: dict[str, list[Any]]) -> PlanReads:
    out = PlanReads(kind, [])
    files = _Files(list(per_file))
    for path, items in per_file.items():
        for item in items:
            fqn = item.storage_index.fqn
            found = files.tensor(path, fqn)
            if found is None:
                out.skipped += 1
                continue
            header, tensor = found
            group = item_name(item)
            box = [
                (int(o), int(o) + int(n))
                for o, n in zip(item.storage_offsets, item.lengths, strict=True)
            ]
            quantized = kind == "quantized" and reader._is_tensor_quantized(fqn)
            if quantized and fqn.endswith("_blocks") and len(box) == 3 == len(tensor.shape) - 1:
                # torch reads whole groups of B bytes (2B values) along dim 2, and all of dim 3
                per_group = 2 * tensor.shape[3]
                (a, b) = box[2]
                box = [box[0], box[1], (a // per_group, -(-b // per_group)), (0, tensor.shape[3])]
            try:
                spans = _box_spans(group, header, tensor, box)
                if spans:  # get_slice faults in the tensor's first page: asked for too
                    out.spans.extend(tensor_first_pages(group, [(header, tensor)], spans))
                if quantized:
                    out.spans.extend(_scale_spans(reader, group, fqn, path, files))
            except ValueError as exc:
                logger.debug("spanwarm: %s in %s: %s", group, path, exc)
                out.skipped += 1
    return out


def plan_reads(reader: Any, plan: Any) -> PlanReads | None:
    """What ``reader`` reads for load plan ``plan``; None if this reader is not understood."""
    kind = reader_kind(reader)
    if kind is None:
        return None
    per_file = _by_file(reader, plan.items)
    reads = _native(reader, per_file) if kind == "native" else _safetensors(reader, kind, per_file)
    if reads.skipped:
        logger.warning(
            "spanwarm: %d of %d read items name bytes that are not in their files; "
            "those are not prefetched",
            reads.skipped,
            len(plan.items),
        )
    return reads
