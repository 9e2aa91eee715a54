"""What every rank of a transformers job would read, with no accelerator and no job.

For each rank, torch's fake process group stands in for the real one: transformers
builds its device meshes, the model on meta and its parallel plans exactly as
``from_pretrained(distributed_config=...)`` would (``prepare_distribute_model``, the
init context, ``maybe_distribute_model``), and the meta state dict's placements then
give that rank's spans, conversions included.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from spanwarm.integrations.transformers.routing import load_spans
from spanwarm.safetensors_header import Checkpoint
from spanwarm.tensor_layout import TensorSpans

__all__ = ["ParallelismError", "rank_load_spans"]


class ParallelismError(ValueError):
    """The model or the distributed config cannot be planned (the message says why)."""


def _model_class(config: Any) -> Any:
    import transformers

    for name in getattr(config, "architectures", None) or ():
        if hasattr(transformers, name):
            return getattr(transformers, name)
    return transformers.AutoModelForCausalLM._model_mapping[type(config)]


def rank_load_spans(
    model_dir: str | os.PathLike[str],
    checkpoint: Checkpoint,
    distributed: dict[str, Any],
    *,
    world: int,
    ranks: Iterable[int],
) -> dict[int, list[TensorSpans]]:
    """Spans each of ``ranks`` reads when ``world`` ranks load ``model_dir`` with
    ``DistributedConfig(**distributed)``."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
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
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ParallelismError(f"{model_dir}: {exc}") from exc

    out: dict[int, list[TensorSpans]] = {}
    for rank in ranks:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            dc, _, mesh_manager = model_class.prepare_distribute_model(distributed_config)
            config.distributed_config = dc
            with ContextManagers(model_class.get_init_context(torch.bfloat16, False, False, False)):
                model = model_class(config)
            model = model_class.maybe_distribute_model(model, dc, mesh_manager)
            mapping = get_model_conversion_mapping(model, None, None)
            out[rank] = load_spans(model, checkpoint, mapping)
        except (ValueError, KeyError, RuntimeError, AssertionError) as exc:
            raise ParallelismError(f"{model_class.__name__} with {distributed}: {exc}") from exc
        finally:
            dist.destroy_process_group()
    return out
