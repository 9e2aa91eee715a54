"""Weight conversions: checkpoint tensors that a loader reshapes into a state-dict tensor.

A Hugging Face MoE checkpoint stores ``experts.{e}.w1.weight`` per expert while the model
holds one packed ``experts.gate_up_proj``; the loader stacks, concatenates or chunks the
pieces on the way in. What it reads of each piece follows transformers' shard-on-read
(``transformers/distributed/sharding_utils.py``), which slices the *source* tensor with
the *target* parameter's placements before any operation runs:

- a source with one dim fewer than the target is the ``index``-th piece of a stack along
  target dim 0 (an expert): when a placement shards target dim 0 and this rank's dim-0
  range, taken as torch reports it (first index, local length), does not contain
  ``index % size``, the piece is not read at all; otherwise target dim ``d > 0`` slices
  source dim ``d - 1`` contiguously by that mesh dim's coordinate, even for a
  ``_StridedShard`` (gate and up are separate sources, so each is simply chunked);
- any other source is sliced with the target's placements applied to its own shape.

Which operations follow doesn't change what is read, so stack, concatenate and chunk are
exact. Any other operation (transpose, interleave, permute, split) reorders or reshapes
data the slicing above does not model, so its sources are read whole.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from spanwarm.checkpoint.placements import (
    IndexRuns,
    Placement,
    Replicate,
    Shard,
    StridedShard,
    local_index_runs,
)

__all__ = [
    "Chunk",
    "Concat",
    "Conversion",
    "Converted",
    "Op",
    "OtherOp",
    "Stack",
    "natural_key",
    "read_runs",
]


@dataclass(frozen=True, slots=True)
class Stack:
    """Stack a list of pieces along a new dim (transformers' ``MergeModulelist``)."""

    dim: int = 0


@dataclass(frozen=True, slots=True)
class Concat:
    """Concatenate the per-pattern tensors along ``dim`` (``Concatenate``)."""

    dim: int


@dataclass(frozen=True, slots=True)
class Chunk:
    """Split one tensor into equal pieces along ``dim`` (``Chunk``)."""

    dim: int


@dataclass(frozen=True, slots=True)
class OtherOp:
    """An operation spanwarm does not model; its sources are read whole."""

    name: str


Op = Stack | Concat | Chunk | OtherOp
EXACT_OPS = (Stack, Concat, Chunk)


@dataclass(frozen=True, slots=True)
class Converted:
    """Where a checkpoint tensor goes: into state-dict key ``target`` (the first one when a
    conversion fills several), collected in the list of source pattern ``source``."""

    target: str
    source: str
    ops: tuple[Op, ...]

    @property
    def exact(self) -> bool:
        return all(isinstance(op, EXACT_OPS) for op in self.ops)


@dataclass(frozen=True)
class Conversion:
    """A rule in transformers' pattern style: a key matching one of ``sources`` (``*`` stands
    for an index, e.g. ``experts.*.w1.weight``) is renamed by replacing the matched part with
    ``target`` and converted by ``ops``."""

    sources: tuple[str, ...]
    target: str
    ops: tuple[Op, ...]
    _regex: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        branches = []
        for i, pattern in enumerate(self.sources):
            body = re.escape(pattern).replace(r"\*", r"\d+")
            if re.search(r"[A-Za-z0-9]$", pattern):
                body += r"(?!\w)"  # end on a name boundary: `weight` is not `weight_scale`
            branches.append(f"(?P<s{i}>{body})")
        object.__setattr__(self, "_regex", re.compile("|".join(branches)))

    def match(self, key: str) -> Converted | None:
        """The route of ``key`` when this rule applies to it."""
        found = self._regex.search(key)
        if found is None:
            return None
        branch = next(name for name, value in found.groupdict().items() if value is not None)
        target = key.replace(found.group(0), self.target, 1)
        return Converted(target, self.sources[int(branch[1:])], self.ops)


@functools.lru_cache(maxsize=1 << 16)
def natural_key(name: str) -> tuple[tuple[int, int] | tuple[int, str] | tuple[int, str, int], ...]:
    """transformers' ``dot_natural_key``: the order it reads checkpoint keys in, and so the
    order pieces are collected (``experts.2`` before ``experts.10``). Memoised: a load
    sorts its checkpoint's keys twice (the transformers integration, then
    :func:`~spanwarm.rank_spans`), a few microseconds a key each time."""
    parts: list[tuple[int, int] | tuple[int, str] | tuple[int, str, int]] = []
    for part in name.split("."):
        if part.isdigit():
            parts.append((0, int(part)))
            continue
        text = part.rstrip("0123456789")
        digits = part[len(text) :]
        parts.append((1, text, int(digits)) if digits else (1, text))
    return tuple(parts)


def read_runs(
    source_shape: Sequence[int],
    target_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Placement],
    index: int | None,
) -> tuple[IndexRuns, ...] | Literal[False] | None:
    """Index runs of a converted source the loader reads at ``coordinate``.

    ``index`` is the source's position in its pattern's list. Returns None for the whole
    source (the slicing cannot be applied to it) and False when nothing is read.
    Memoised: every layer's experts ask the same questions.
    """
    return _read_runs(
        tuple(source_shape),
        tuple(target_shape),
        tuple(mesh_shape),
        tuple(coordinate),
        tuple(placements),
        index,
    )


@functools.lru_cache(maxsize=65536)
def _read_runs(
    source_shape: tuple[int, ...],
    target_shape: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    coordinate: tuple[int, ...],
    placements: tuple[Placement, ...],
    index: int | None,
) -> tuple[IndexRuns, ...] | Literal[False] | None:
    ndim = len(target_shape)
    dims = [
        (mesh_dim, p.dim + ndim if p.dim < 0 else p.dim)
        for mesh_dim, p in enumerate(placements)
        if isinstance(p, Shard | StridedShard)
    ]
    if any(not 0 <= dim < ndim for _, dim in dims):
        return None
    if index is None or len(source_shape) != ndim - 1:
        if any(dim >= len(source_shape) for _, dim in dims):
            return None
        # Negative dims count from the target's last dim, as transformers counts them.
        on_source: list[Placement] = list(placements)
        for mesh_dim, dim in dims:
            p = placements[mesh_dim]
            on_source[mesh_dim] = (
                StridedShard(dim, p.split_factor) if isinstance(p, StridedShard) else Shard(dim)
            )
        return local_index_runs(source_shape, mesh_shape, coordinate, on_source)

    # One piece of a stack along target dim 0.
    if any(dim == 0 for _, dim in dims):
        held = local_index_runs(target_shape, mesh_shape, coordinate, placements)[0]
        first = held[0][0] if held else 0
        length = sum(stop - start for start, stop in held)
        if not first <= index % target_shape[0] < first + length:
            return False
    by_source_dim: list[Placement] = [Replicate()] * len(placements)
    for mesh_dim, dim in dims:
        if dim > 0:
            by_source_dim[mesh_dim] = Shard(dim - 1)
    return local_index_runs(source_shape, mesh_shape, coordinate, by_source_dim)
