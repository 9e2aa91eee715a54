"""What every rank of a transformers job would read, with no accelerator and no job.

torch's fake process group stands in for the real one: transformers builds its device
meshes, the model on meta and its parallel plans exactly as
``from_pretrained(distributed_config=...)`` would (``prepare_distribute_model``, the init
context, ``maybe_distribute_model``). The placements are the same on every rank, so one
meta model serves them all: each rank's spans come from its coordinate in the slice of
the root mesh each parameter lives on (the slice rank 0 built may not contain it).
Building one model per rank in one process does not work: torch caches sharding results
keyed by mesh layout and hands back the first rank's mesh. Pipeline parallelism gives
ranks different layers and is not planned here.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from spanwarm.checkpoint.resolve import Checkpoint
from spanwarm.checkpoint.tensor_layout import TensorSpans
from spanwarm.integrations.transformers.routing import load_spans

__all__ = ["ParallelismError", "meta_model", "rank_load_spans"]


class ParallelismError(ValueError):
    """The model or the distributed config cannot be planned (the message says why)."""


def _model_class(config: Any) -> Any:
    import transformers

    for name in getattr(config, "architectures", None) or ():
        if hasattr(transformers, name):
            return getattr(transformers, name)
    return transformers.AutoModelForCausalLM._model_mapping[type(config)]


@contextmanager
def meta_model(
    model_dir: str | os.PathLike[str], distributed: dict[str, Any], *, world: int
) -> Iterator[tuple[Any, Any]]:
    """``(model, weight mapping)``: the model on meta as ``world`` ranks load ``model_dir``
    with ``DistributedConfig(**distributed)``, its parameters DTensors with their final
    placements, inside a fake process group that lasts while the block runs."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from transformers import AutoConfig, DistributedConfig
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.utils.generic import ContextManagers

    if dist.is_initialized():
        raise ParallelismError("a process group already exists in this process")
    try:
        config = AutoConfig.from_pretrained(os.fspath(model_dir))
        model_class = _model_class(config)
        distributed_config = DistributedConfig(**distributed)
    except Exception as exc:  # transformers raises many kinds; each is one line for plan
        raise ParallelismError(f"{model_dir}: {exc}") from exc

    if (distributed_config.pp_size or 1) > 1:
        raise ParallelismError("pipeline parallel loads are not planned (pp_size > 1)")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        try:
            dc, _, mesh_manager = model_class.prepare_distribute_model(distributed_config)
            config.distributed_config = dc
            with ContextManagers(model_class.get_init_context(torch.bfloat16, False, False, False)):
                model = model_class(config)
            # As from_pretrained does: before distributing, which renames classes (FSDP...).
            mapping = get_model_conversion_mapping(model, None, None)
            model = model_class.maybe_distribute_model(model, dc, mesh_manager)
        except Exception as exc:
            raise ParallelismError(f"{model_class.__name__} with {distributed}: {exc}") from exc
        yield model, mapping
    finally:
        dist.destroy_process_group()


def rank_load_spans(
    model_dir: str | os.PathLike[str],
    checkpoint: Checkpoint,
    distributed: dict[str, Any],
    *,
    world: int,
    ranks: Iterable[int],
    first_pages: bool = False,
) -> dict[int, list[TensorSpans]]:
    """Spans each of ``ranks`` reads when ``world`` ranks load ``model_dir`` with
    ``DistributedConfig(**distributed)``; with ``first_pages``, what each asks the
    daemon for (the pages its slices fault in too: :func:`load_spans`)."""
    with meta_model(model_dir, distributed, world=world) as (model, mapping):
        try:
            return {
                rank: load_spans(model, checkpoint, mapping, rank=rank, first_pages=first_pages)
                for rank in ranks
            }
        except Exception as exc:
            raise ParallelismError(f"{type(model).__name__} with {distributed}: {exc}") from exc
