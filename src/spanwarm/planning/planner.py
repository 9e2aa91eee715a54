"""What-if node planning with no torch and no daemon.

"Which bytes does node N warm if this checkpoint is loaded by W ranks, L per node, with
these placements?" Ranks map to mesh coordinates in row-major order and node N holds
ranks ``N*L .. N*L+L-1``. Each tensor takes the placements of the first rule whose
regex matches its name (``re.search``), and is replicated when none does. The node's
spans go through the same per-file cost model the daemon uses.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from math import prod
from typing import Any

import numpy as np

from spanwarm.checkpoint.placements import (
    IndexRuns,
    Placement,
    Replicate,
    Shard,
    StridedShard,
    local_index_runs,
    parse_placements,
)
from spanwarm.checkpoint.resolve import Checkpoint
from spanwarm.checkpoint.safetensors_header import Header
from spanwarm.checkpoint.spans import SpanTable
from spanwarm.checkpoint.tensor_layout import TensorSpans, global_shape, piece_spans
from spanwarm.planning.costmodel import DEFAULT_SEEK_COST, FilePlan, plan_file

__all__ = ["NodePlan", "PlacementRule", "plan_files", "plan_node", "plan_node_spans"]

_RULE = re.compile(
    r"(?P<pattern>.+?)=(?P<placements>\[?\s*(?:_?StridedShard|Shard|Replicate|Partial)\(.*)"
)


@dataclass(frozen=True)
class PlacementRule:
    """Tensors whose name matches ``pattern`` are placed with ``placements``."""

    pattern: re.Pattern[str]
    placements: tuple[Placement, ...]

    @classmethod
    def parse(cls, text: str) -> PlacementRule:
        """Parse ``'REGEX=PLACEMENTS'``, e.g. ``'experts=[Shard(0),Replicate()]'``."""
        match = _RULE.fullmatch(text.strip())
        if match is None:
            raise ValueError(f"--place {text!r}: expected REGEX=PLACEMENTS, e.g. 'proj=Shard(0)'")
        try:
            pattern = re.compile(match["pattern"])
        except re.error as exc:
            raise ValueError(f"--place {text!r}: bad regex: {exc}") from exc
        return cls(pattern, parse_placements(match["placements"]))


@dataclass(frozen=True)
class NodePlan:
    node: int
    ranks: tuple[int, ...]
    seek_cost_bytes: int
    files: tuple[FilePlan, ...]

    @property
    def needed_bytes(self) -> int:
        return sum(f.needed_bytes for f in self.files)

    @property
    def warm_bytes(self) -> int:
        return sum(f.warm_bytes for f in self.files)

    def to_json(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "ranks": list(self.ranks),
            "seek_cost_bytes": self.seek_cost_bytes,
            "needed_bytes": self.needed_bytes,
            "warm_bytes": self.warm_bytes,
            "files": [f.to_json() for f in self.files],
        }


def plan_files(
    headers: Iterable[Header], spans: Mapping[str, SpanTable], seek_cost: int
) -> tuple[FilePlan, ...]:
    """Plan every file; a file with no spans is listed with nothing to warm."""
    empty = SpanTable.of(())
    return tuple(
        plan_file(
            h.path, h.file_size, spans.get(h.path, empty), seek_cost, header_bytes=h.data_start
        )
        for h in headers
    )


def _placements_for(
    name: str, rules: Sequence[PlacementRule], mesh_dims: int
) -> tuple[Placement, ...]:
    for rule in rules:
        if rule.pattern.search(name):
            return rule.placements
    return (Replicate(),) * mesh_dims


def check_layout(
    world: int,
    local_world: int,
    node: int,
    mesh_shape: Sequence[int] | None,
    rules: Sequence[PlacementRule],
    seek_cost: int,
) -> tuple[int, ...]:
    """Validate a what-if layout (ValueErrors name the flag); returns the mesh shape."""
    mesh = tuple(mesh_shape) if mesh_shape is not None else (world,)
    if world < 1 or local_world < 1 or world % local_world:
        raise ValueError(
            f"--world {world} must be a positive multiple of --local-world {local_world}"
        )
    if not 0 <= node < world // local_world:
        raise ValueError(f"--node {node} is outside 0..{world // local_world - 1}")
    if prod(mesh) != world or any(k < 1 for k in mesh):
        raise ValueError(f"--mesh {'x'.join(map(str, mesh))} does not hold {world} ranks")
    for rule in rules:
        if len(rule.placements) != len(mesh):
            raise ValueError(
                f"--place {rule.pattern.pattern!r}: {len(rule.placements)} placements for a "
                f"{len(mesh)}-d mesh"
            )
    if seek_cost < 0:
        raise ValueError(f"--seek-cost must be >= 0, got {seek_cost}")
    return mesh


def plan_node(
    checkpoint: Checkpoint,
    *,
    world: int,
    local_world: int,
    node: int = 0,
    mesh_shape: Sequence[int] | None = None,
    rules: Iterable[PlacementRule] = (),
    seek_cost: int = DEFAULT_SEEK_COST,
) -> NodePlan:
    """The node plan for ``node`` when every rank holds what ``rules`` place on it."""
    rules = tuple(rules)
    mesh = check_layout(world, local_world, node, mesh_shape, rules, seek_cost)
    ranks = tuple(range(node * local_world, (node + 1) * local_world))
    coordinates = [tuple(int(c) for c in np.unravel_index(r, mesh)) for r in ranks]

    columns: dict[str, list[tuple[int, int, int, int]]] = {h.path: [] for h in checkpoint.headers}
    distinct: dict[tuple[Placement, ...], set[tuple[int, ...]]] = {}
    for name, pieces in checkpoint.pieces.items():
        placements = _placements_for(name, rules, len(mesh))
        if placements not in distinct:
            distinct[placements] = _distinct_coordinates(coordinates, placements)
        shape = global_shape(pieces)
        try:
            needed: set[tuple[IndexRuns, ...]] = {
                local_index_runs(shape, mesh, coord, placements) for coord in distinct[placements]
            }
        except ValueError as exc:
            raise ValueError(f"tensor {name!r} of shape {list(shape)}: {exc}") from exc
        for runs in needed:
            for header, info in pieces:
                base = header.data_start + info.begin
                columns[header.path].extend(
                    (base + start, length, stride, count)
                    for start, length, stride, count in piece_spans(info, runs)
                )
    tables = {path: _table(rows) for path, rows in columns.items()}
    return NodePlan(node, ranks, seek_cost, plan_files(checkpoint.headers, tables, seek_cost))


def plan_node_spans(
    checkpoint: Checkpoint,
    spans: Iterable[TensorSpans],
    *,
    node: int,
    ranks: Sequence[int],
    seek_cost: int = DEFAULT_SEEK_COST,
) -> NodePlan:
    """The node plan for spans its ranks worked out themselves (e.g. by a loader's rules)."""
    columns: dict[str, list[tuple[int, int, int, int]]] = {h.path: [] for h in checkpoint.headers}
    for s in spans:
        columns[s.path].append((s.offset, s.length, s.stride, s.count))
    tables = {path: _table(rows) for path, rows in columns.items()}
    return NodePlan(
        node, tuple(ranks), seek_cost, plan_files(checkpoint.headers, tables, seek_cost)
    )


def _distinct_coordinates(
    coordinates: Iterable[tuple[int, ...]], placements: tuple[Placement, ...]
) -> set[tuple[int, ...]]:
    """Coordinates that can hold different indices: those on replicating mesh dims don't matter."""
    sharding = [isinstance(p, Shard | StridedShard) for p in placements]
    return {
        tuple(c if s else 0 for c, s in zip(coord, sharding, strict=True)) for coord in coordinates
    }


def _table(rows: list[tuple[int, int, int, int]]) -> SpanTable:
    if not rows:
        return SpanTable.of(())
    cols = np.array(rows, dtype=np.int64).T
    return SpanTable(cols[0], cols[1], cols[2], cols[3])
