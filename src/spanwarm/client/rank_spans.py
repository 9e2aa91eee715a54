"""``rank_spans``: the exact checkpoint bytes a rank will read, from its (meta) state dict.

For each checkpoint tensor, the state-dict value it maps to says what this rank holds:
a DTensor holds the indices its placements give its mesh coordinate (nothing when the
rank is outside the mesh); a plain tensor holds everything. Those global index runs are
intersected with what each file stores of the tensor and laid out as strided spans.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from spanwarm.placements import (
    IndexRuns,
    Placement,
    Replicate,
    Shard,
    StridedShard,
    local_index_runs,
)
from spanwarm.safetensors_header import Checkpoint, open_checkpoint
from spanwarm.tensor_layout import TensorSpans, global_shape, stored_tensor_spans

if TYPE_CHECKING:
    import torch

__all__ = ["KeyMap", "TensorSpans", "model_placements", "rank_spans"]

logger = logging.getLogger("spanwarm.client")

KeyMap = Mapping[str, str | None] | Callable[[str], str | None]
"""Checkpoint key -> state-dict key, or None for a checkpoint tensor no state-dict key reads."""

Everything = None  # needed runs meaning "the whole tensor"


def _mapper(key_map: KeyMap | None) -> Callable[[str], str | None]:
    if key_map is None:
        return lambda name: name
    if callable(key_map):
        return key_map
    mapping = key_map
    return lambda name: mapping.get(name, name)


def model_placements(placements: Sequence[Any]) -> tuple[Placement, ...] | None:
    """torch placements -> :mod:`spanwarm.placements`; None if one is not understood."""
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


def _needed_runs(
    name: str, value: Any, stored_shape: tuple[int, ...], stored_dtype: str
) -> tuple[IndexRuns, ...] | Literal[False] | None:
    """Global index runs this rank reads of ``name``: None = all of it, False = none."""
    from torch.distributed.tensor import DTensor

    if not isinstance(value, DTensor):
        return Everything
    mesh = value.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return False
    shape = tuple(value.shape)
    f4_packed = stored_dtype == "F4" and str(value.dtype) == "torch.float4_e2m1fn_x2"
    logical = (*shape[:-1], shape[-1] * 2) if f4_packed and shape else shape
    placements = model_placements(value.placements)
    if logical != stored_shape or placements is None:
        why = (
            f"unsupported placements {value.placements}"
            if placements is None
            else f"shape {list(logical)} differs from the checkpoint's {list(stored_shape)}"
        )
        logger.debug("%s: %s; reading the whole tensor", name, why)
        return Everything
    runs = local_index_runs(shape, tuple(mesh.shape), tuple(coordinate), placements)
    if f4_packed and runs:  # one torch element holds two logical F4 values
        runs = (*runs[:-1], tuple((2 * a, 2 * b) for a, b in runs[-1]))
    return runs


def rank_spans(
    state_dict: Mapping[str, torch.Tensor | Any],
    checkpoint: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | Checkpoint,
    *,
    key_map: KeyMap | None = None,
    unmatched: Literal["warm", "skip"] = "warm",
) -> list[TensorSpans]:
    """The byte spans of ``checkpoint`` this rank reads to fill ``state_dict``.

    ``state_dict`` values are DTensors (meta is fine) or plain tensors (which need the
    whole checkpoint tensor). ``key_map`` maps a checkpoint key to a state-dict key or
    None (a mapping leaves absent keys unchanged). Checkpoint tensors that no state-dict
    key maps to are listed whole (``unmatched="warm"``: a loader probably reads them
    through some conversion) or left out (``"skip"``). Spans come grouped by tensor in
    state-dict order, then unmatched tensors in file order. Pure: no daemon involved.
    """
    if unmatched not in ("warm", "skip"):
        raise ValueError(f"unmatched must be 'warm' or 'skip', not {unmatched!r}")
    ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else open_checkpoint(checkpoint)
    to_state_key = _mapper(key_map)
    by_state_key: dict[str, list[str]] = {}
    unmatched_names: list[str] = []
    for name in ckpt.pieces:
        key = to_state_key(name)
        if key is not None and key in state_dict:
            by_state_key.setdefault(key, []).append(name)
        else:
            unmatched_names.append(name)

    missing = [key for key in state_dict if key not in by_state_key]
    if missing:
        shown = ", ".join(missing[:20]) + (
            f", ... ({len(missing)} in all)" if len(missing) > 20 else ""
        )
        logger.warning("%d state-dict keys are not in the checkpoint: %s", len(missing), shown)

    out: list[TensorSpans] = []
    for key, value in state_dict.items():
        for name in by_state_key.get(key, ()):
            pieces = ckpt.pieces[name]
            runs = _needed_runs(name, value, global_shape(pieces), pieces[0][1].dtype)
            if runs is not False:
                out.extend(stored_tensor_spans(name, pieces, runs))
    if unmatched == "warm":
        for name in unmatched_names:
            out.extend(stored_tensor_spans(name, ckpt.pieces[name], Everything))
    return out
