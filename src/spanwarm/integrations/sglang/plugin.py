"""spanwarm in SGLang's weight loading: every rank asks the node's daemon for exactly the
bytes its weight loaders will copy, and each tensor is read once it is warm.

:func:`install` runs from SGLang's plugin entry point (``sglang.srt.plugins``) in every
process, the schedulers (one per rank) included, where ``SPANWARM_SGLANG=1``. It
registers AROUND hooks with SGLang's ``HookRegistry``, which ``load_plugins`` applies:

- ``DefaultModelLoader.load_model``: where the checkpoint is a local directory of
  safetensors files, the dry run (:func:`loader_dry_run`) names this rank's reads before
  the model is built, and they are requested then: the daemon warms while the model is
  built;
- ``DefaultModelLoader.load_weights_and_postprocess``: the load of the weights, at whose
  end the rank's request ends;
- the two safetensors iterators the default loader picks from
  (``buffered_multi_thread_safetensors_weights_iterator``, the default, and
  ``safetensors_weights_iterator``): in the dry run they hand out meta tensors of the
  headers; in the load, with the daemon there, one iterator replaces both: the same
  files in the same order, the same ``safe_open(...).get_tensor`` zero-copy views in the
  same key order, each made once the tensor is warm (or reading it here is sooner) and
  reported read when the weight loaders ask for the next. SGLang's own whole-file
  prefetch (``--weight-loader-prefetch-checkpoints``) is not started beside spanwarm's
  request;
- ``get_model_loader``: a loader other than the default one gets one log line.

Loads that do not go through those iterators (other load formats and loaders,
``--weight-loader-disable-mmap``) get one log line saying so and run as they would
without spanwarm. Nothing here fails a load: any error is one warning, and the load goes
on cold.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from spanwarm.integrations.gate import GatedReads
from spanwarm.integrations.meta_dry_run import (
    DryRun,
    DryRunUnsupported,
    WeightsOnMeta,
    budget_from_environment,
    dry_run,
    in_dry_run,
    meta_weights,
    swapped,
)
from spanwarm.integrations.server_load import RankLoad, Server

__all__ = ["install", "loader_dry_run"]

logger = logging.getLogger("sglang.spanwarm")

_LOADER = "sglang.srt.model_loader.loader"
_UTILS = "sglang.srt.model_loader.weight_utils"
# SGLang's module-level cache of rotary embeddings, shared by every model a process
# builds: the twin's meta layers must not be served to the rank's model built after it.
_ROPE_CACHE = ("sglang.srt.layers.rotary_embedding.factory", "_ROPE_DICT")


class _Uncached(dict[Any, Any]):
    """The rotary embeddings' cache while the twin is built: it caches nothing (SGLang
    would take a cached meta layer for one a freed model left behind)."""

    def get(self, key: Any, default: Any = None) -> Any:
        return default


_WARMED_FORMATS = ("auto", "safetensors")
DRY_RUN_S = "SPANWARM_SGLANG_DRY_RUN_S"


def _job() -> str:
    """One job per SGLang instance: its schedulers (the ranks) share the parent that
    started them (the engine, or its data-parallel controller)."""
    return f"sglang-{os.getppid()}"


# SPANWARM_SGLANG_SPANS_DIR: each rank's request, as JSON (rank-<R>.json);
# SPANWARM_SGLANG_READ_YOURSELF=0: always wait for the daemon
_SERVER = Server("SPANWARM_SGLANG", logger, _job)


def install() -> None:
    """Register the hooks (once per process); SGLang's ``load_plugins`` applies them."""
    _SERVER.install(_register_hooks)


def _register_hooks() -> None:
    """Register the hooks; SGLang's ``load_plugins`` applies them."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, hook in (
        (f"{_LOADER}.DefaultModelLoader.load_model", _around_load_model),
        (
            f"{_LOADER}.DefaultModelLoader.load_weights_and_postprocess",
            _around_load_weights,
        ),
        (f"{_UTILS}.buffered_multi_thread_safetensors_weights_iterator", _around_iterator),
        (f"{_UTILS}.safetensors_weights_iterator", _around_iterator),
        (f"{_LOADER}.get_model_loader", _around_get_model_loader),
    ):
        HookRegistry.register(target, hook, HookType.AROUND)


class _Load(RankLoad):
    """One load of a rank's model by ``DefaultModelLoader.load_model`` and its request."""

    def __init__(self, loader: Any, model_config: Any, target_device: Any) -> None:
        super().__init__(_SERVER)
        self.loader, self.model_config, self.target_device = loader, model_config, target_device

    def start(self) -> None:
        """Before the model is built: the dry run on its meta twin, and the request."""
        if _SERVER.nothing_to_ask():
            return
        try:
            plan = loader_dry_run(self.loader, self.model_config, self.target_device)
        except Exception as exc:
            _SERVER.loading_cold(exc)
            return
        self.begin(plan)


class _Current(threading.local):
    load: _Load | None = None


_current = _Current()


def _around_load_model(original: Callable[..., Any], self: Any, *args: Any, **kw: Any) -> Any:
    """The model's load from the start: the request goes out before the model is built."""
    try:
        why_not = _not_warmed(self, kw.get("model_config"))
    except Exception as exc:
        why_not = f"its load settings are unknown to spanwarm ({exc})"
    if why_not is not None:
        _SERVER.say_once(why_not)
        return original(self, *args, **kw)
    try:
        load = _Load(self, kw["model_config"], torch.device(kw["device_config"].device))
    except Exception as exc:
        _SERVER.loading_cold(exc)
        return original(self, *args, **kw)
    previous, _current.load = _current.load, load
    try:
        load.start()
        return original(self, *args, **kw)
    finally:
        _current.load = previous
        load.end()


def _around_load_weights(
    original: Callable[..., Any], model: Any, weights: Any, target_device: Any
) -> Any:
    """The weights' load (a staticmethod: no self): at its end the request ends."""
    load = _current.load
    if load is None:
        _SERVER.say_once(
            "weights loaded outside DefaultModelLoader.load_model (startup overlap, an "
            "update of the weights): spanwarm warms nothing"
        )
        return original(model, weights, target_device)
    if load.loading:
        return original(model, weights, target_device)
    load.loading = True
    try:
        return original(model, weights, target_device)
    finally:
        load.loading = False
        load.end()


def _around_iterator(
    original: Callable[..., Iterator[tuple[str, torch.Tensor]]],
    hf_weights_files: list[str],
    *args: Any,
    **kwargs: Any,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Either safetensors iterator: meta tensors in the dry run; gated views in the load."""
    if in_dry_run():
        # Both iterators hand out the files in the order given and each file's keys sorted.
        yield from meta_weights(list(hf_weights_files))
        return
    load = _current.load
    gate = load.gate if load is not None and load.loading else None
    options: dict[str, Any] = {}
    if gate is not None:
        try:
            options = inspect.signature(original).bind(hf_weights_files, *args, **kwargs).arguments
        except Exception as exc:  # a call this plugin does not know: SGLang's iterator
            logger.warning("spanwarm: reading unwaited (%s)", exc)
            gate = None
    if load is None or gate is None or options.get("disable_mmap") or not load.daemon_present():
        # Not this load's, nothing requested, or no daemon: SGLang's iterator as it is
        # (its own prefetch included, where configured).
        yield from original(hf_weights_files, *args, **kwargs)
        return
    yield from _gated_views(
        list(hf_weights_files), gate, bool(options.get("drop_cache_after_load"))
    )


def _gated_views(
    files: list[str], gate: GatedReads, drop_cache_after_load: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """What SGLang's safetensors iterators hand out with mmap on: per file, in the order
    given, ``safe_open(...).get_tensor`` of each key, sorted. ``get_tensor`` reads the
    tensor's first page as it makes the view: it waits for the tensor first."""
    from safetensors import safe_open

    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in sorted(f.keys()):
                gate.before_read(name)
                tensor = f.get_tensor(name)
                yield name, tensor
                del tensor
                gate.after_read(name)  # the weight loaders copied it: they ask for the next
        if drop_cache_after_load:
            with contextlib.suppress(Exception):  # advice, as in SGLang's iterators
                from sglang.srt.model_loader import weight_utils

                weight_utils._drop_file_cache_after_load(path)


def _around_get_model_loader(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    loader = original(*args, **kwargs)
    with contextlib.suppress(Exception):  # a log line, never worth a failed load
        from sglang.srt.model_loader.loader import DefaultModelLoader

        if type(loader) is not DefaultModelLoader:
            fmt = _format(loader.load_config)
            _SERVER.say_once(
                f"load format {fmt!r} ({type(loader).__name__}) reads through its own "
                "reader: spanwarm warms nothing"
            )
    return loader


def _format(load_config: Any) -> str:
    fmt = getattr(load_config, "load_format", "auto")
    return str(getattr(fmt, "value", fmt))


def _not_warmed(loader: Any, model_config: Any) -> str | None:
    """Why spanwarm warms nothing for this ``load_model`` (None: it does)."""
    from sglang.srt.model_loader.loader import DefaultModelLoader
    from sglang.srt.runtime_context import get_model

    if type(loader) is not DefaultModelLoader:  # a subclass's super().load_model()
        return f"{type(loader).__name__} loads its own way: spanwarm warms nothing"
    fmt = _format(loader.load_config)
    if fmt not in _WARMED_FORMATS:
        return f"load format {fmt!r} reads through its own reader: spanwarm warms nothing"
    if getattr(model_config, "modelopt_quant", None):
        return "ModelOpt's base model loads through transformers: spanwarm warms nothing"
    if get_model().weight_loader_disable_mmap:
        return "--weight-loader-disable-mmap reads whole files: spanwarm warms nothing"
    path = getattr(model_config, "model_path", None)
    if not isinstance(path, str) or not os.path.isdir(path):
        return "the model is not a local directory: spanwarm warms nothing"
    with os.scandir(path) as entries:
        if not any(e.name.endswith(".safetensors") for e in entries):
            return "no safetensors files in the model's directory: spanwarm warms nothing"
    return None


def loader_dry_run(
    loader: Any, model_config: Any, target_device: Any, *, budget_s: float | None = None
) -> DryRun:
    """The reads of ``loader.load_model`` in this rank (its parallel groups set up), found
    with a meta twin of the model: built as ``load_model`` builds it, and loaded as
    ``load_weights_and_postprocess`` loads it (``load_weights_only``, over the loader's
    own ``_get_all_weights``, whose safetensors iterators hand out meta tensors)."""
    from sglang.srt.model_loader import loader as loader_module
    from sglang.srt.model_loader.utils import set_default_torch_dtype

    shadows: list[Any] = []

    def load() -> object:
        quant_config = loader_module._get_quantization_config(model_config, loader.load_config)
        with (
            set_default_torch_dtype(model_config.dtype),
            swapped(*_ROPE_CACHE, empty=_Uncached),
            WeightsOnMeta(),
        ):
            shadows.append(
                loader_module._initialize_model(model_config, loader.load_config, quant_config)
            )
        with set_default_torch_dtype(model_config.dtype), torch.no_grad():
            weights = loader._get_all_weights(model_config, shadows[0])
            loader_module.DefaultModelLoader.load_weights_only(shadows[0], weights, target_device)
        return None

    def weights() -> Iterable[object]:
        if not shadows:
            raise DryRunUnsupported("no model to list the weights of")
        return loader._get_all_weights(model_config, shadows[0])  # type: ignore[no-any-return]

    # The loader times its weights' load from its first weights iterator: the dry run's
    # must not start that clock.
    clock = loader.counter_before_loading_weights
    try:
        budget = budget_from_environment(DRY_RUN_S) if budget_s is None else budget_s
        return dry_run(load, weights, budget_s=budget)
    finally:
        loader.counter_before_loading_weights = clock
