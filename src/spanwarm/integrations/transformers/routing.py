"""Checkpoint key -> state-dict key or conversion route, decided by transformers itself.

transformers renames every checkpoint key with all of the model's ``WeightRenaming``s and
then at most one ``WeightConverter`` (``core_model_loading.rename_source_key``), adding or
stripping the base-model prefix against the meta state dict. Calling that same function
keeps spanwarm right for every model family and scoping rule transformers knows; only
the conversion operations are translated, into :mod:`spanwarm.checkpoint.conversions` ops.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from spanwarm.checkpoint.conversions import (
    Chunk,
    Concat,
    Converted,
    Op,
    OtherOp,
    Stack,
    natural_key,
)
from spanwarm.checkpoint.resolve import Checkpoint
from spanwarm.checkpoint.tensor_layout import TensorSpans
from spanwarm.client.rank_spans import rank_spans

__all__ = ["REQUIRED", "checkpoint_routes", "load_spans", "spanwarm_ops"]

REQUIRED = {
    "transformers.core_model_loading": (
        "rename_source_key",
        "WeightConverter",
        "WeightRenaming",
        "MergeModulelist",
        "Concatenate",
        "Chunk",
    ),
}
"""The internals this module reads; the integration checks them before it patches anything."""


def spanwarm_ops(operations: Iterable[Any]) -> tuple[Op, ...]:
    """transformers ``ConversionOps`` -> spanwarm ops; unknown ones become :class:`OtherOp`."""
    from transformers.core_model_loading import Chunk as TfChunk
    from transformers.core_model_loading import Concatenate, MergeModulelist

    out: list[Op] = []
    for op in operations:
        if type(op) is MergeModulelist:  # exact types: a subclass may reorder data
            out.append(Stack(int(op.dim)))
        elif type(op) is Concatenate:
            out.append(Concat(int(op.dim)))
        elif type(op) is TfChunk:
            out.append(Chunk(int(op.dim)))
        else:
            out.append(OtherOp(type(op).__name__))
    return tuple(out)


def checkpoint_routes(
    keys: Iterable[str],
    weight_mapping: Sequence[Any] | None,
    meta_state_dict: dict[str, Any],
    base_model_prefix: str | None,
) -> Callable[[str], str | Converted | None]:
    """Where transformers puts each of ``keys``: a key map for :func:`spanwarm.rank_spans`.

    A key that reaches no state-dict entry maps to None: transformers never reads it.
    """
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        rename_source_key,
    )

    # Renaming marks transforms as used (which decides what save_pretrained writes back)
    # and some keep state between keys: route with a copy, leaving the load's own alone.
    mapping = copy.deepcopy(list(weight_mapping or ()))
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    ops = {id(c): spanwarm_ops(getattr(c, "operations", ())) for c in converters}
    routes: dict[str, str | Converted | None] = {}
    for key in keys:
        target, pattern = rename_source_key(
            key, renamings, converters, base_model_prefix, meta_state_dict
        )
        if target not in meta_state_dict and key in meta_state_dict:
            target, pattern = rename_source_key(key, [], [], base_model_prefix, meta_state_dict)
        if target not in meta_state_dict:
            routes[key] = None
        elif pattern is None:
            routes[key] = target
        else:
            routes[key] = Converted(target, pattern, ops[id(by_pattern[pattern])])
    return routes.get


def load_spans(
    model: Any,
    checkpoint: Checkpoint,
    weight_mapping: Sequence[Any] | None,
    *,
    rank: int | None = None,
    by_target: bool = False,
    first_pages: bool = False,
) -> list[TensorSpans]:
    """What this rank (or global ``rank``) reads of ``checkpoint`` when transformers loads it
    into ``model`` (a distributed meta model), in the order transformers reads it.

    With its thread pool (the default) transformers reads checkpoint keys in
    ``dot_natural_key`` order; without it (``by_target``: ``HF_DEACTIVATE_ASYNC_LOAD``,
    disk offload, quantizing on load) it reads target by target, in the order each target
    was first met, one source pattern's pieces after another. ``first_pages``: with the
    page each slice faults in (:func:`~spanwarm.client.rank_spans.rank_spans`), for the
    request; without, exactly what the loader copies.
    """
    names = sorted(checkpoint.pieces, key=natural_key)
    meta_state_dict = model.state_dict()
    route = checkpoint_routes(names, weight_mapping, meta_state_dict, model.base_model_prefix)
    order: dict[str, tuple[int, ...]] = {}
    targets_met: dict[str, int] = {}
    patterns_met: dict[tuple[str, str], int] = {}
    for i, name in enumerate(names):
        to = route(name)
        if to is None:
            continue
        target = to.target if isinstance(to, Converted) else to
        pattern = to.source if isinstance(to, Converted) else name
        t = targets_met.setdefault(target, len(targets_met))
        p = patterns_met.setdefault((target, pattern), len(patterns_met))
        order[name] = (t, p, i) if by_target else (i,)
    targets = {to.target if isinstance(to, Converted) else to for to in map(route, order)}
    state = {k: v for k, v in meta_state_dict.items() if k in targets}
    spans = rank_spans(
        state, checkpoint, key_map=route, unmatched="skip", rank=rank, first_pages=first_pages
    )
    return sorted(spans, key=lambda s: order[s.tensor])  # stable: first pages stay first
