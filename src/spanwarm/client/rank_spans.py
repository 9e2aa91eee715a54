"""``rank_spans``: the exact checkpoint bytes a rank will read, from its (meta) state dict.

For each checkpoint tensor, the state-dict value it maps to says what this rank holds:
a DTensor holds the indices its placements give its mesh coordinate (nothing when the
rank is outside the mesh); a plain tensor holds everything. Those global index runs are
intersected with what each file stores of the tensor and laid out as strided spans.
Checkpoint tensors a loader converts (per-expert pieces stacked into one parameter,
concatenated or chunked ones) are read as :mod:`spanwarm.checkpoint.conversions` describes.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from spanwarm.checkpoint.conversions import Conversion, Converted, natural_key, read_runs
from spanwarm.checkpoint.placements import (
    IndexRuns,
    Placement,
    Replicate,
    Shard,
    StridedShard,
    local_index_runs,
)
from spanwarm.checkpoint.resolve import Checkpoint, open_checkpoint
from spanwarm.checkpoint.safetensors_header import Header, TensorInfo
from spanwarm.checkpoint.tensor_layout import TensorSpans, global_shape, stored_tensor_spans
from spanwarm.client.first_pages import tensor_first_pages

if TYPE_CHECKING:
    import torch

__all__ = ["KeyMap", "MeshCoordinates", "TensorSpans", "model_placements", "rank_spans"]

logger = logging.getLogger("spanwarm.client")

KeyMap = Mapping[str, str | None] | Callable[[str], str | Converted | None]
"""Checkpoint key -> state-dict key (or its conversion route), or None for a checkpoint
tensor no state-dict key reads."""

Everything = None  # needed runs meaning "the whole tensor"


def _mapper(key_map: KeyMap | None) -> Callable[[str], str | Converted | None]:
    if key_map is None:
        return lambda name: name
    if callable(key_map):
        return key_map
    mapping = key_map
    return lambda name: mapping.get(name, name)


def model_placements(placements: Sequence[Any]) -> tuple[Placement, ...] | None:
    """torch placements -> :mod:`spanwarm.checkpoint.placements`; None if one is not understood."""
    from torch.distributed.tensor.placement_types import Shard as TorchShard
    from torch.distributed.tensor.placement_types import _StridedShard

    out: list[Placement] = []
    for p in placements:
        if isinstance(p, _StridedShard):  # before Shard: older torch subclasses it
            out.append(StridedShard(p.dim, int(p.split_factor)))
        elif isinstance(p, TorchShard):
            out.append(Shard(p.dim))
        elif p.is_replicate() or p.is_partial():
            out.append(Replicate())
        else:
            return None
    return tuple(out)


@functools.lru_cache(maxsize=256)
def _known_placements(typed: tuple[tuple[type, Any], ...]) -> tuple[Placement, ...] | None:
    return model_placements([p for _, p in typed])


def _placements_of(value: Any) -> tuple[Placement, ...] | None:
    """:func:`model_placements` of a DTensor's, memoised: a model has a few kinds and
    thousands of tensors, and torch's isinstance checks cost microseconds each. Keyed by
    type too: a torch whose _StridedShard subclasses Shard may compare them equal."""
    placements = value.placements
    try:
        return _known_placements(tuple((type(p), p) for p in placements))
    except TypeError:  # a placement that cannot be hashed
        return model_placements(placements)


class MeshCoordinates:
    """Where ``rank`` (this process, if None) sits in each mesh; None when outside it.

    For another rank, a parameter's mesh may be a slice of the root mesh that does not
    contain it (an FSDP-only sub-mesh built on rank 0 holds ranks 0 and 2, not 1): the
    coordinate is then found in the sibling slice along the same dims, from the mesh's
    layout over the whole root. Memoised per mesh object: a model has a handful of meshes
    and thousands of tensors.
    """

    def __init__(self, rank: int | None) -> None:
        self.rank = rank
        self._known: dict[int, tuple[Any, tuple[int, ...] | None]] = {}
        self._shapes: dict[int, tuple[Any, tuple[int, ...]]] = {}

    def shape(self, mesh: Any) -> tuple[int, ...]:
        """``tuple(mesh.shape)``, memoised: torch computes it from the layout each time."""
        known = self._shapes.get(id(mesh))
        if known is not None and known[0] is mesh:
            return known[1]
        shape = tuple(mesh.shape)
        self._shapes[id(mesh)] = (mesh, shape)
        return shape

    def __call__(self, mesh: Any) -> tuple[int, ...] | None:
        known = self._known.get(id(mesh))
        if known is not None and known[0] is mesh:
            return known[1]
        coordinate: tuple[int, ...] | None
        if self.rank is None:
            found = mesh.get_coordinate()
            coordinate = None if found is None else tuple(found)
        else:
            # (slices, *mesh.shape): every slice of the root like this one (torch >= 2.9).
            every_slice = mesh._layout.remap_to_tensor(mesh._rank_map)
            where = (every_slice == self.rank).nonzero()
            coordinate = tuple(int(i) for i in where[0, 1:].tolist()) if len(where) else None
        self._known[id(mesh)] = (mesh, coordinate)
        return coordinate


@functools.cache
def _dtensor_type() -> Any:
    """torch's DTensor, imported once (an import statement per tensor costs a lookup)."""
    from torch.distributed.tensor import DTensor

    return DTensor


def _read_runs(
    name: str,
    value: Any,
    stored_shape: tuple[int, ...],
    stored_dtype: str,
    coordinates: MeshCoordinates,
    converted: Converted | None,
    index: int,
) -> tuple[IndexRuns, ...] | Literal[False] | None:
    """Global index runs this rank reads of checkpoint tensor ``name``, which fills DTensor
    ``value`` directly or through ``converted``: None = all of it, False = none."""
    mesh = value.device_mesh
    coordinate = coordinates(mesh)
    if coordinate is None:
        return False
    placements = _placements_of(value)
    if converted is None:
        mesh_shape = coordinates.shape(mesh)
        return _direct_runs(
            name, value, stored_shape, stored_dtype, mesh_shape, coordinate, placements
        )
    why = ""
    if not converted.exact:
        why = f"conversion {[str(op) for op in converted.ops]} is not stack/concatenate/chunk"
    elif placements is None:
        why = f"unsupported placements {value.placements}"
    elif str(value.dtype) == "torch.float4_e2m1fn_x2":
        why = "packed float4 targets are not modelled through conversions"
    else:
        runs = read_runs(
            stored_shape, tuple(value.shape), coordinates.shape(mesh), coordinate, placements, index
        )
        if runs is not None:
            return runs
        why = f"placements {value.placements} do not fit shape {list(stored_shape)}"
    logger.debug("%s -> %s: %s; reading the whole tensor", name, converted.target, why)
    return Everything


def _direct_runs(
    name: str,
    value: Any,
    stored_shape: tuple[int, ...],
    stored_dtype: str,
    mesh_shape: tuple[int, ...],
    coordinate: tuple[int, ...],
    placements: tuple[Placement, ...] | None,
) -> tuple[IndexRuns, ...] | None:
    """The runs of a DTensor read as stored (no conversion); None = all of it."""
    shape = tuple(value.shape)
    f4_packed = stored_dtype == "F4" and str(value.dtype) == "torch.float4_e2m1fn_x2"
    logical = (*shape[:-1], shape[-1] * 2) if f4_packed and shape else shape
    if logical != stored_shape or placements is None:
        why = (
            f"unsupported placements {value.placements}"
            if placements is None
            else f"shape {list(logical)} differs from the checkpoint's {list(stored_shape)}"
        )
        logger.debug("%s: %s; reading the whole tensor", name, why)
        return Everything
    runs = local_index_runs(shape, mesh_shape, coordinate, placements)
    if f4_packed and runs:  # one torch element holds two logical F4 values
        runs = (*runs[:-1], tuple((2 * a, 2 * b) for a, b in runs[-1]))
    return runs


def _route(
    name: str,
    to_state_key: Callable[[str], str | Converted | None],
    conversions: Sequence[Conversion],
) -> str | Converted | None:
    """Rename ``name`` with the key map, then let the first matching conversion take it."""
    route = to_state_key(name)
    if isinstance(route, str):
        for conversion in conversions:
            converted = conversion.match(route)
            if converted is not None:
                return converted
    return route


def rank_spans(
    state_dict: Mapping[str, torch.Tensor | Any],
    checkpoint: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | Checkpoint,
    *,
    key_map: KeyMap | None = None,
    conversions: Sequence[Conversion] = (),
    unmatched: Literal["warm", "skip"] = "warm",
    rank: int | None = None,
    first_pages: bool = False,
) -> list[TensorSpans]:
    """The byte spans of ``checkpoint`` this rank reads to fill ``state_dict``.

    ``state_dict`` values are DTensors (meta is fine) or plain tensors (which need the
    whole checkpoint tensor). ``key_map`` maps a checkpoint key to a state-dict key, a
    :class:`~spanwarm.checkpoint.conversions.Converted` route, or None (a mapping leaves absent keys
    unchanged); then the first of ``conversions`` matching the renamed key converts it
    (pieces of one pattern are indexed in :func:`~spanwarm.checkpoint.conversions.natural_key`
    order, as transformers collects them). Checkpoint tensors that reach no state-dict
    key are listed whole (``unmatched="warm"``: a loader probably reads them through
    some conversion) or left out (``"skip"``). Spans come grouped by tensor in
    state-dict order, then unmatched tensors in file order. ``rank`` computes the spans of
    that global rank instead of this process's (what-if planning: the placements are the
    same on every rank, only the mesh coordinate differs). ``first_pages``: for a load
    that slices each tensor with safetensors' ``get_slice``, also the page of each sliced
    tensor's first byte, which the slice faults in whatever it copies (an empty slice of
    a tensor read as stored too; see :mod:`.first_pages`), as a span of the tensor before
    its others. Pure: no daemon involved.
    """
    if unmatched not in ("warm", "skip"):
        raise ValueError(f"unmatched must be 'warm' or 'skip', not {unmatched!r}")
    ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else open_checkpoint(checkpoint)
    if key_map is None and not conversions:  # each name is its own key: no routing
        return _identity_spans(state_dict, ckpt, unmatched, MeshCoordinates(rank), first_pages)
    to_state_key = _mapper(key_map)
    by_state_key: dict[str, list[tuple[str, Converted | None, int]]] = {}
    collected: dict[tuple[str, str], int] = {}  # (target, source pattern) -> pieces so far
    unmatched_names: list[str] = []
    # Pieces are numbered in transformers' order, as transformers collects them.
    for name in sorted(ckpt.pieces, key=natural_key):
        route = _route(name, to_state_key, conversions)
        key = route.target if isinstance(route, Converted) else route
        if key is None or key not in state_dict:
            unmatched_names.append(name)
            continue
        index = 0
        if isinstance(route, Converted):
            index = collected.get((key, route.source), 0)
            collected[(key, route.source)] = index + 1
        by_state_key.setdefault(key, []).append(
            (name, route if isinstance(route, Converted) else None, index)
        )

    _warn_missing([key for key in state_dict if key not in by_state_key])
    coordinates = MeshCoordinates(rank)
    out: list[TensorSpans] = []
    for key, value in state_dict.items():
        for name, converted, index in by_state_key.get(key, ()):
            out.extend(
                _tensor_spans(
                    name, value, ckpt.pieces[name], coordinates, converted, index, first_pages
                )
            )
    if unmatched == "warm":
        in_file_order = set(unmatched_names)
        for name in ckpt.pieces:
            if name in in_file_order:
                out.extend(stored_tensor_spans(name, ckpt.pieces[name], Everything))
    return out


def _identity_spans(
    state_dict: Mapping[str, Any],
    ckpt: Checkpoint,
    unmatched: Literal["warm", "skip"],
    coordinates: MeshCoordinates,
    first_pages: bool,
) -> list[TensorSpans]:
    """:func:`rank_spans` where every checkpoint name is its own state-dict key: a lookup
    per key, nothing sorted or routed (a resident rank's request is this, per tensor)."""
    pieces_of = ckpt.pieces
    _warn_missing([key for key in state_dict if key not in pieces_of])
    out: list[TensorSpans] = []
    for key, value in state_dict.items():
        pieces = pieces_of.get(key)
        if pieces is not None:
            out.extend(_tensor_spans(key, value, pieces, coordinates, None, 0, first_pages))
    if unmatched == "warm":
        for name, pieces in pieces_of.items():
            if name not in state_dict:
                out.extend(stored_tensor_spans(name, pieces, Everything))
    return out


def _tensor_spans(
    name: str,
    value: Any,
    pieces: Sequence[tuple[Header, TensorInfo]],
    coordinates: MeshCoordinates,
    converted: Converted | None,
    index: int,
    first_pages: bool,
) -> list[TensorSpans]:
    """The spans this rank reads of checkpoint tensor ``name`` (stored as ``pieces``), with
    their first pages where asked (:func:`rank_spans`)."""
    if not isinstance(value, _dtensor_type()):
        return stored_tensor_spans(name, pieces, Everything)  # a plain tensor: all of it
    shape = global_shape(pieces)
    runs = _read_runs(name, value, shape, pieces[0][1].dtype, coordinates, converted, index)
    if runs is False:
        return []  # outside the tensor's mesh: not sliced at all
    spans = stored_tensor_spans(name, pieces, runs)
    if not first_pages or (not spans and converted is not None):
        # A converted piece the rank holds nothing of is not sliced (transformers: the
        # read recorder's expert-parallel loads show no such slice).
        return spans
    return tensor_first_pages(name, pieces, spans)


def _warn_missing(missing: list[str]) -> None:
    if missing:
        shown = ", ".join(missing[:20]) + (
            f", ... ({len(missing)} in all)" if len(missing) > 20 else ""
        )
        logger.warning("%d state-dict keys are not in the checkpoint: %s", len(missing), shown)
