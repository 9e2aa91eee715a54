"""A torch-free model of DTensor placements: which global indices a mesh coordinate holds.

Rules (torch 2.13 ``placement_types.py`` / ``_utils.py``, checked against real DTensors
in the tests):

- ``Shard(d)`` splits the current local extent of tensor dim ``d`` like ``torch.chunk``:
  chunks of ``ceil(n / k)``, so trailing coordinates may hold fewer indices or none.
- ``_StridedShard(d, sf)`` first chunks the extent into ``sf`` pieces, chunks each piece
  into ``k``, and coordinate ``r`` concatenates chunk ``r`` of every piece: its indices
  are not contiguous.
- ``Replicate()`` and ``Partial()`` leave the dim whole (a partial tensor reads like a
  replicated one).
- Placements apply left to right over mesh dims; each one subdivides the indices the
  earlier ones left on that tensor dim. The local index list stays sorted throughout, so
  it is represented as sorted, disjoint runs ``(start, stop)``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

__all__ = [
    "IndexRuns",
    "Partial",
    "Placement",
    "Replicate",
    "Shard",
    "StridedShard",
    "local_index_runs",
    "parse_placements",
]

IndexRuns = tuple[tuple[int, int], ...]
"""Sorted, disjoint, non-empty half-open runs of global indices on one tensor dim."""


@dataclass(frozen=True, slots=True)
class Shard:
    dim: int

    def __str__(self) -> str:
        return f"Shard({self.dim})"


@dataclass(frozen=True, slots=True)
class StridedShard:
    """torch's ``_StridedShard(dim, split_factor)``."""

    dim: int
    split_factor: int

    def __post_init__(self) -> None:
        if self.split_factor < 1:
            raise ValueError(f"_StridedShard split_factor must be >= 1, got {self.split_factor}")

    def __str__(self) -> str:
        return f"_StridedShard({self.dim},sf={self.split_factor})"


@dataclass(frozen=True, slots=True)
class Replicate:
    def __str__(self) -> str:
        return "Replicate()"


@dataclass(frozen=True, slots=True)
class Partial:
    def __str__(self) -> str:
        return "Partial()"


Placement = Shard | StridedShard | Replicate | Partial


def _chunk(n: int, k: int, r: int) -> tuple[int, int]:
    """Positions ``[start, stop)`` of chunk ``r`` when ``torch.chunk`` splits ``n`` into ``k``."""
    size = -(-n // k)
    return min(r * size, n), min((r + 1) * size, n)


def _take(runs: IndexRuns, positions: Sequence[tuple[int, int]]) -> IndexRuns:
    """The indices at local ``positions`` (sorted position runs) of the index list ``runs``."""
    out: list[tuple[int, int]] = []
    run_iter = iter(runs)
    run_start, run_stop = next(run_iter, (0, 0))
    base = 0  # local position of run_start
    for pos_start, pos_stop in positions:
        while pos_start < pos_stop:
            while pos_start >= base + (run_stop - run_start):
                base += run_stop - run_start
                run_start, run_stop = next(run_iter)
            lo = run_start + (pos_start - base)
            hi = min(run_stop, run_start + (pos_stop - base))
            if out and out[-1][1] == lo:
                out[-1] = (out[-1][0], hi)
            else:
                out.append((lo, hi))
            pos_start += hi - lo
    return tuple(out)


def _positions(n: int, split_factor: int, k: int, r: int) -> list[tuple[int, int]]:
    """Local positions coordinate ``r`` of ``k`` keeps; ``split_factor`` 0 means ``Shard``."""
    if split_factor == 0:
        start, stop = _chunk(n, k, r)
        return [(start, stop)] if start < stop else []
    out = []
    for piece in range(split_factor):
        piece_start, piece_stop = _chunk(n, split_factor, piece)
        start, stop = _chunk(piece_stop - piece_start, k, r)
        if start < stop:
            out.append((piece_start + start, piece_start + stop))
    return out


@lru_cache(maxsize=65536)
def _dim_runs(size: int, steps: tuple[tuple[int, int, int], ...]) -> IndexRuns:
    """Index runs left on a dim of ``size`` after ``steps`` of (split_factor, k, r)."""
    runs: IndexRuns = ((0, size),) if size else ()
    for split_factor, k, r in steps:
        length = sum(stop - start for start, stop in runs)
        runs = _take(runs, _positions(length, split_factor, k, r))
    return runs


def local_index_runs(
    shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Placement],
) -> tuple[IndexRuns, ...]:
    """For every tensor dim, the global indices held at ``coordinate`` of the mesh.

    A dim with no indices (an empty shard) makes the whole local tensor empty.
    """
    return _local_index_runs(tuple(shape), tuple(mesh_shape), tuple(coordinate), tuple(placements))


@lru_cache(maxsize=65536)
def _local_index_runs(
    shape: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    coordinate: tuple[int, ...],
    placements: tuple[Placement, ...],
) -> tuple[IndexRuns, ...]:
    ndim = len(shape)
    if not len(mesh_shape) == len(coordinate) == len(placements):
        raise ValueError(
            f"mesh shape {tuple(mesh_shape)}, coordinate {tuple(coordinate)} and "
            f"{len(placements)} placements must have one entry per mesh dim"
        )
    steps: list[list[tuple[int, int, int]]] = [[] for _ in range(ndim)]
    for mesh_dim, (placement, k, r) in enumerate(
        zip(placements, mesh_shape, coordinate, strict=True)
    ):
        if not 0 <= r < k:
            raise ValueError(f"coordinate {r} is outside mesh dim {mesh_dim} of size {k}")
        if isinstance(placement, Replicate | Partial):
            continue
        dim = placement.dim + ndim if placement.dim < 0 else placement.dim
        if not 0 <= dim < ndim:
            raise ValueError(f"{placement} on mesh dim {mesh_dim} does not fit a {ndim}-d tensor")
        split_factor = placement.split_factor if isinstance(placement, StridedShard) else 0
        steps[dim].append((split_factor, k, r))
    return tuple(_dim_runs(size, tuple(s)) for size, s in zip(shape, steps, strict=True))


_PLACEMENT = re.compile(
    r"\s*(?:(?P<shard>Shard)\(\s*(?:dim\s*=\s*)?(?P<sdim>-?\d+)\s*\)"
    r"|(?P<strided>_?StridedShard)\(\s*(?:dim\s*=\s*)?(?P<tdim>-?\d+)\s*,\s*"
    r"(?:sf|split_factor)\s*=\s*(?P<sf>\d+)\s*\)"
    r"|(?P<replicate>Replicate)\(\s*\)"
    r"|(?P<partial>Partial)\([^)]*\))\s*"
)


def parse_placements(text: str) -> tuple[Placement, ...]:
    """Parse ``Shard(0)`` or ``[_StridedShard(0,sf=2),Shard(0)]``: one placement per mesh dim."""
    body = text.strip()
    if body.startswith("[") and body.endswith("]"):
        body = body[1:-1]
    placements: list[Placement] = []
    pos = 0
    while True:
        match = _PLACEMENT.match(body, pos)
        if match is None:
            raise ValueError(f"cannot parse placements {text!r} at {body[pos:]!r}")
        if match["shard"]:
            placements.append(Shard(int(match["sdim"])))
        elif match["strided"]:
            placements.append(StridedShard(int(match["tdim"]), int(match["sf"])))
        elif match["replicate"]:
            placements.append(Replicate())
        else:
            placements.append(Partial())
        pos = match.end()
        if pos == len(body):
            return tuple(placements)
        if body[pos] != ",":
            raise ValueError(f"cannot parse placements {text!r}: expected ',' at {body[pos:]!r}")
        pos += 1
