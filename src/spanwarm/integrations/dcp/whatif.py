"""What a node reads when a DCP checkpoint is loaded with a given layout (``spanwarm plan``).

A DCP load reads, for each tensor of the state dict, the stored chunks that overlap the
box the rank holds (torch's ``create_read_items_for_chunk_list``, what
``DefaultLoadPlanner`` calls), and its reader then reads what :func:`.reads.plan_reads`
says. A rank's box comes from its placements: ``Shard`` and ``Replicate`` give one box
per tensor. DCP describes a DTensor as one box, which a ``_StridedShard`` is not, so
loaders redistribute those to ``Shard`` first (transformers does); so does the plan.

Placements come from ``--place`` rules on a mesh (every checkpoint entry is loaded, as a
resume does), or from transformers for a model saved with ``save_pretrained(...,
distributed_checkpoint=True)`` (its state dict, on meta, in a fake process group).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from spanwarm.checkpoint.placements import (
    Placement,
    Replicate,
    Shard,
    StridedShard,
    local_index_runs,
)
from spanwarm.checkpoint.resolve import INDEX_FILE
from spanwarm.checkpoint.safetensors_header import read_header
from spanwarm.checkpoint.spans import SpanTable
from spanwarm.checkpoint.tensor_layout import TensorSpans
from spanwarm.errors import MetadataFormatError
from spanwarm.integrations.dcp.metadata import load_metadata
from spanwarm.integrations.dcp.reads import plan_reads
from spanwarm.planning.costmodel import plan_file
from spanwarm.planning.planner import NodePlan, PlacementRule

__all__ = ["Box", "dcp_format", "placement_box", "plan_dcp_node"]

DCP_SHARD = re.compile(r"shard-\d{5}-model-\d{5}-of-\d{5}\.safetensors")

Box = tuple[tuple[int, ...], tuple[int, ...]]
"""A rank's part of a tensor: (offsets, sizes)."""


def dcp_format(directory: str | os.PathLike[str]) -> str | None:
    """``"native"`` (``.metadata``), ``"safetensors"`` (torch's distributed HF shards, no
    index) or None. Shards consolidated in place have an index: the safetensors loaders
    open the consolidated files through it, and so does the plan."""
    path = Path(directory)
    if not path.is_dir():
        return None
    if (path / ".metadata").is_file():
        return "native"
    if (path / INDEX_FILE).exists():
        return None
    return "safetensors" if any(DCP_SHARD.fullmatch(n) for n in os.listdir(path)) else None


def placement_box(
    shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Placement],
) -> Box | None:
    """The box ``coordinate`` holds; None when it holds nothing. ``_StridedShard`` counts
    as ``Shard`` on its dim, as loaders redistribute it before a DCP load."""
    plain = [Shard(p.dim) if isinstance(p, StridedShard) else p for p in placements]
    runs = local_index_runs(shape, mesh_shape, coordinate, plain)
    if any(not r for r in runs):
        return None
    return tuple(r[0][0] for r in runs), tuple(r[0][1] - r[0][0] for r in runs)


def _reader(directory: str, fmt: str) -> tuple[Any, Any]:
    """The checkpoint's reader, set up, and its metadata, read without trusting the files:
    ``.metadata`` through :func:`load_metadata`; every ``*.safetensors`` torch's reader
    would open validated by spanwarm first (a FIFO, a huge or malformed header or sharding
    info is a :class:`CheckpointError` before torch touches it)."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader

    if fmt == "native":  # torch would pickle.load it: never run what it names
        reader: Any = FileSystemReader(directory)
        metadata = load_metadata(os.path.join(directory, ".metadata"))
        _check_inside(directory, metadata)
    else:
        for name in sorted(os.listdir(directory)):
            if name.endswith(".safetensors"):
                read_header(os.path.join(directory, name))
        reader = HuggingFaceStorageReader(directory)
        try:
            metadata = reader.read_metadata()
        except Exception as exc:  # what torch makes of headers spanwarm accepted
            raise MetadataFormatError(directory, f"torch cannot read its metadata: {exc}") from exc
    reader.set_up_storage_reader(metadata, True)
    return reader, metadata


def _check_inside(directory: str, metadata: Any) -> None:
    """Every data file the metadata names is a relative path inside ``directory``."""
    root = os.path.realpath(directory)
    for info in metadata.storage_data.values():
        relative = getattr(info, "relative_path", None)
        if not isinstance(relative, str) or os.path.isabs(relative):
            raise MetadataFormatError(
                os.path.join(directory, ".metadata"), f"data file {relative!r} is not relative"
            )
        real = os.path.realpath(os.path.join(directory, relative))
        if os.path.commonpath([real, root]) != root:
            raise MetadataFormatError(
                os.path.join(directory, ".metadata"), f"data file {relative!r} is outside {root}"
            )


def _read_items(metadata: Any, boxes: dict[str, Box | None], whole_bytes: bool) -> list[Any]:
    """The load plan's items for these boxes (and, for a resume, every non-tensor entry)."""
    import torch
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        MetadataIndex,
    )
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    items: list[Any] = []
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            if whole_bytes:
                zero = torch.Size((0,))
                index = MetadataIndex(fqn)
                items.append(ReadItem(LoadItemType.BYTE_IO, index, zero, index, zero, zero))
            continue
        if fqn not in boxes or boxes[fqn] is None:
            continue
        offsets, sizes = boxes[fqn]  # type: ignore[misc]
        chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
        items.extend(create_read_items_for_chunk_list(fqn, md, [chunk]))
    return items


def _files(reader: Any, directory: str, fmt: str) -> list[tuple[str, int, int]]:
    """(path, size, header bytes) of every data file the reader may open."""
    if fmt == "native":
        paths = sorted(
            {
                os.path.abspath(os.fspath(reader.fs.concat_path(reader.path, i.relative_path)))
                for i in reader.storage_data.values()
            }
        )
        return [(p, os.stat(p).st_size, 0) for p in paths]
    headers = [read_header(p) for p in sorted(Path(directory).glob("*.safetensors"))]
    return [(os.path.abspath(h.path), h.file_size, h.data_start) for h in headers]


def plan_dcp_node(
    directory: str | os.PathLike[str],
    *,
    node: int,
    ranks: Sequence[int],
    boxes_of: Callable[[int, dict[str, tuple[int, ...]]], dict[str, Box | None]],
    whole_bytes: bool,
    seek_cost: int,
) -> NodePlan:
    """The node plan for ``ranks`` of a DCP checkpoint; ``boxes_of(rank, shapes)`` gives
    each rank's box per tensor (absent: not loaded)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan

    path = os.fspath(directory)
    fmt = dcp_format(path)
    if fmt is None:
        raise ValueError(f"{path} is not a DCP checkpoint (.metadata or shard-*.safetensors)")
    reader, metadata = _reader(path, fmt)
    shapes = {
        fqn: tuple(md.size)
        for fqn, md in metadata.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
    }
    spans: list[TensorSpans] = []
    for rank in ranks:
        items = _read_items(metadata, boxes_of(rank, shapes), whole_bytes)
        try:
            reads = plan_reads(reader, LoadPlan(items))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            # what torch's reader would trip over too: storage data that does not fit
            raise MetadataFormatError(path, f"its load plans do not fit its files: {exc}") from exc
        if reads is not None:
            spans.extend(reads.spans)
    by_file: dict[str, list[tuple[int, int, int, int]]] = {}
    for s in spans:
        by_file.setdefault(os.path.abspath(s.path), []).append(
            (s.offset, s.length, s.stride, s.count)
        )
    files = tuple(
        plan_file(p, size, _table(by_file.get(p, [])), seek_cost, header_bytes=header)
        for p, size, header in _files(reader, path, fmt)
    )
    return NodePlan(node, tuple(ranks), seek_cost, files)


def _table(rows: list[tuple[int, int, int, int]]) -> SpanTable:
    if not rows:
        return SpanTable.of(())
    cols = np.array(rows, dtype=np.int64).T
    return SpanTable(cols[0], cols[1], cols[2], cols[3])


def rule_boxes(
    rules: Iterable[PlacementRule], mesh: Sequence[int]
) -> Callable[[int, dict[str, tuple[int, ...]]], dict[str, Box | None]]:
    """Boxes from ``--place`` rules on ``mesh`` (ranks in row-major order): every tensor."""
    rules = tuple(rules)

    def boxes(rank: int, shapes: dict[str, tuple[int, ...]]) -> dict[str, Box | None]:
        coordinate = tuple(int(c) for c in np.unravel_index(rank, tuple(mesh)))
        out: dict[str, Box | None] = {}
        for fqn, shape in shapes.items():
            placements: Sequence[Placement] = next(
                (r.placements for r in rules if r.pattern.search(fqn)), (Replicate(),) * len(mesh)
            )
            try:
                out[fqn] = placement_box(shape, mesh, coordinate, placements)
            except ValueError as exc:
                raise ValueError(f"tensor {fqn!r} of shape {list(shape)}: {exc}") from exc
        return out

    return boxes


def model_boxes(model: Any) -> Callable[[int, dict[str, tuple[int, ...]]], dict[str, Box | None]]:
    """Boxes of a transformers model's state dict (meta DTensors): the keys it loads."""
    from spanwarm.client.rank_spans import MeshCoordinates, model_placements

    state = model.state_dict()

    def boxes(rank: int, shapes: dict[str, tuple[int, ...]]) -> dict[str, Box | None]:
        from torch.distributed.tensor import DTensor

        coordinates = MeshCoordinates(rank)
        out: dict[str, Box | None] = {}
        for key, value in state.items():
            shape = tuple(value.shape)
            if not isinstance(value, DTensor):
                out[key] = ((0,) * len(shape), shape)
                continue
            coordinate = coordinates(value.device_mesh)
            placements = model_placements(value.placements)
            if coordinate is None:
                out[key] = None
            elif placements is None:
                out[key] = ((0,) * len(shape), shape)
            else:
                mesh = tuple(value.device_mesh.shape)
                out[key] = placement_box(shape, mesh, coordinate, placements)
        return out

    return boxes
