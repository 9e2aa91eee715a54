"""A vLLM rank's exact reads of a safetensors checkpoint, known before any byte is read.

A second model is built on the meta device with the worker's own configuration (its
tensor, pipeline and expert parallel groups are already set up), and its
``load_weights`` runs over meta tensors made from the safetensors headers, under the
shared dry run (:mod:`spanwarm.integrations.meta_dry_run`). The loader's own
``get_all_weights`` hands them out, so the dry run sees the real load's files, sources,
prefixes and EP filter; only the safetensors iterator is replaced (by
:func:`~spanwarm.integrations.meta_dry_run.meta_weights`, which keeps its file order, the
natural sort, and its key order, ``safe_open(...).keys()``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import torch

from spanwarm.integrations.meta_dry_run import (
    DryRun,
    DryRunUnsupported,
    HandedOut,
    WeightsOnMeta,
    budget_from_environment,
    dry_run,
    in_dry_run,
    meta_weights,
    whole_tensors,
)

__all__ = [
    "DryRun",
    "HandedOut",
    "dry_run",
    "in_dry_run",
    "loader_dry_run",
    "meta_model",
    "meta_weights",
    "set_up_filters",
    "whole_tensors",
]


def loader_dry_run(
    loader: Any,
    model_config: Any,
    vllm_config: Any,
    model: Any = None,
    *,
    budget_s: float | None = None,
) -> DryRun:
    """The reads of ``loader.load_weights(model, model_config)`` in this worker (its
    parallel groups set up), found with a meta twin of the model ``vllm_config`` and
    ``model_config`` describe. The coarse answer lists what the loader hands out for
    ``model``, or for the twin where there is no model yet (or none at all here)."""
    shadows: list[Any] = []

    def load() -> object:
        shadows.append(meta_model(vllm_config, model_config))
        set_up_filters(loader, model_config, shadows[0])
        with torch.no_grad():
            return shadows[0].load_weights(loader.get_all_weights(model_config, shadows[0]))

    def weights() -> Iterable[object]:
        listed = model if model is not None else next(iter(shadows), None)
        if listed is None:
            raise DryRunUnsupported("no model to list the weights of")
        return loader.get_all_weights(model_config, listed)  # type: ignore[no-any-return]

    # The loader times "Loading weights took" from its first weights iterator: the dry
    # run's must not start that clock.
    clock = getattr(loader, "counter_before_loading_weights", None)
    try:
        return dry_run(load, weights, budget_s=dry_run_budget() if budget_s is None else budget_s)
    finally:
        if clock is not None:
            loader.counter_before_loading_weights = clock


def set_up_filters(loader: Any, model_config: Any, model: Any) -> None:
    """What the loader's ``load_weights`` sets up before it lists the weights, so that a
    dry run before it (or without it) lists the same: the EP weight filter (the local
    experts) and the multimodal encoder-only filter (from the model's class)."""
    ep_filter = getattr(loader, "_init_ep_weight_filter", None)
    if callable(ep_filter):
        ep_filter(model_config)
    encoder_only = getattr(loader, "_init_mm_encoder_only_weight_filter", None)
    if callable(encoder_only):
        encoder_only(model, model_config)


# vLLM's module-level caches of layers, shared by every model a process builds (module,
# name): the twin's meta layers must not be served to the worker's model built after it.
_LAYER_CACHES = (("vllm.model_executor.layers.rotary_embedding", "_ROPE_DICT"),)


def meta_model(vllm_config: Any, model_config: Any) -> torch.nn.Module:
    """A second model of the worker's configuration, its weights on the meta device.
    Layers register themselves by name in the compilation config as they are built, and
    some are cached by vLLM for every model the process builds: the second model's go to
    fresh tables, and the worker's are put back."""
    import importlib

    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    compilation = vllm_config.compilation_config
    saved = {
        name: getattr(compilation, name)
        for name in ("static_forward_context", "static_all_moe_layers")
        if hasattr(compilation, name)
    }
    caches: list[tuple[Any, str, Any]] = []
    for module_name, name in _LAYER_CACHES:
        with contextlib.suppress(ImportError):
            module = importlib.import_module(module_name)
            if isinstance(getattr(module, name, None), dict):
                caches.append((module, name, getattr(module, name)))
    for name, value in saved.items():
        setattr(compilation, name, type(value)())
    for module, name, _ in caches:
        setattr(module, name, {})
    try:
        with set_default_torch_dtype(model_config.dtype), WeightsOnMeta():
            model: torch.nn.Module = initialize_model(
                vllm_config=vllm_config, model_config=model_config
            )
    finally:
        for name, value in saved.items():
            setattr(compilation, name, value)
        for module, name, value in caches:
            setattr(module, name, value)
    return model


def dry_run_budget() -> float:
    """Seconds a dry run may take (``SPANWARM_VLLM_DRY_RUN_S``, default 60)."""
    return budget_from_environment("SPANWARM_VLLM_DRY_RUN_S")
