"""spanwarm in vLLM's weight loading: every worker asks the node's daemon for exactly the
bytes its weight loaders will copy, and each tensor is read once it is warm.

:func:`install` runs from vLLM's general plugin entry point in every process, workers
included, before the model is built, where ``SPANWARM_VLLM=1``. It wraps three things of
vLLM's default loader:

- ``DefaultModelLoader.load_model``: where the checkpoint is a local directory of
  safetensors files, the dry run (:mod:`.dry_run`) names this rank's reads before the
  model is even built, and they are requested then: the daemon warms while the worker
  builds its model;
- ``DefaultModelLoader.load_weights``: the load of the weights, at whose end the
  worker's request ends;
- the safetensors iterator it calls (``default_loader.safetensors_weights_iterator``): on
  its first tensor, the dry run and the request where they were not made before (a
  remote model's files are known only now; a reload of a built model's weights); then
  each tensor waits until it is warm (or until reading it here is sooner), is handed to
  the weight loaders, and is reported read when they ask for the next one. vLLM's own
  whole-file prefetch (automatic on NFS and Lustre) is not started beside spanwarm's
  request.

Loads that do not go through that iterator (other load formats and strategies) get one
log line saying so and run as they would without spanwarm. Nothing here fails a load:
any error is one warning, and the load goes on cold.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from spanwarm.integrations.gate import GatedReads
from spanwarm.integrations.server_load import RankLoad, Server
from spanwarm.integrations.vllm.dry_run import DryRun, in_dry_run, loader_dry_run, meta_weights

__all__ = ["install"]

logger = logging.getLogger("vllm.spanwarm")  # vLLM's handler and format

_LAZY = (None, "lazy")  # the strategies whose reads are the weight loaders' copies


def _job() -> str:
    """One job per vLLM instance: its workers are the job's ranks."""
    from vllm.config import get_current_vllm_config

    instance = getattr(get_current_vllm_config(), "instance_id", "") or str(os.getppid())
    return f"vllm-{instance}"


# SPANWARM_VLLM_SPANS_DIR: each rank's request, as JSON (rank-<R>.json);
# SPANWARM_VLLM_READ_YOURSELF=0: always wait for the daemon
_SERVER = Server("SPANWARM_VLLM", logger, _job)


def install() -> None:
    """Wrap vLLM's default loader (once per process)."""
    _SERVER.install(_wrap_default_loader)


def _wrap_default_loader() -> None:
    """Wrap vLLM's default loader."""
    from vllm.model_executor.model_loader import default_loader
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    from vllm.model_executor.model_loader.ep_weight_filter import should_skip_weight
    from vllm.model_executor.model_loader.weight_utils import _natural_sort_key

    loader_class = default_loader.DefaultModelLoader
    iterator = default_loader.safetensors_weights_iterator
    for needed in ("get_all_weights", "load_weights", "load_model"):
        if not callable(getattr(loader_class, needed, None)):
            raise RuntimeError(f"DefaultModelLoader.{needed} is missing")
    default_loader.safetensors_weights_iterator = _gated_iterator(
        iterator, _natural_sort_key, should_skip_weight
    )
    loader_class.load_weights = _load_weights(loader_class.load_weights)
    loader_class.load_model = _load_model(loader_class.load_model)
    BaseModelLoader.__init__ = _say_what_other_loaders_get(BaseModelLoader.__init__, loader_class)


class _Load(RankLoad):
    """One load of a worker's model by the default loader and its request: made before
    the model is built (:meth:`start_early`), where the checkpoint is a local directory
    of safetensors files, so that the daemon warms while the model is built; else on the
    first tensor handed out (:meth:`start`)."""

    def __init__(self, loader: Any, model_config: Any, vllm_config: Any = None) -> None:
        super().__init__(_SERVER)
        self.loader, self.model_config, self.vllm_config = loader, model_config, vllm_config
        self.model: Any = None  # the model being loaded, once built
        self.upcoming: Iterator[str] = iter(())  # the names handed out next, in order
        self._started = False

    @property
    def started(self) -> bool:
        return self._started

    def start_early(self) -> None:
        """Before the model is built: the dry run on its meta twin alone, and the request.
        Where that fails, :meth:`start` tries again with the real model."""
        if self._started:
            return
        try:
            if not _local_safetensors(self.model_config):
                return
            if _SERVER.nothing_to_ask():
                self._started = True
                return
            plan = loader_dry_run(self.loader, self.model_config, self.vllm_config)
        except Exception as exc:  # the twin could not be built: on the first tensor
            logger.debug("spanwarm: no dry run before the model is built (%s)", exc)
            return
        self._started = True
        self.begin(plan)

    def start(self) -> GatedReads | None:
        """On the first tensor: the dry run and the request, unless made before the
        model was built (once; None: load cold)."""
        if self._started:
            return self.gate
        self._started = True
        if _SERVER.nothing_to_ask():
            return None
        try:
            plan = self._dry_run()
        except Exception as exc:
            _SERVER.loading_cold(exc)
            return None
        self.begin(plan)
        return self.gate

    def _dry_run(self) -> DryRun:
        from vllm.config import get_current_vllm_config

        config = self.vllm_config or get_current_vllm_config()
        return loader_dry_run(self.loader, self.model_config, config, self.model)

    def begin(self, plan: DryRun) -> None:
        super().begin(plan)
        if self.gate is not None:  # the iterator waits for these, in this order
            self.upcoming = iter([item.name for item in plan.handed_out])


def _local_safetensors(model_config: Any) -> bool:
    """Whether the checkpoint is a local directory the default loader reads safetensors
    files of (its "auto" choice where any is there): only then is the dry run sure to
    read headers alone before the model is built. (A torchao checkpoint is read by
    another strategy, which load_weights picks.)"""
    if getattr(model_config, "quantization", None) == "torchao":
        return False
    path = getattr(model_config, "model", None)
    if not isinstance(path, str) or not os.path.isdir(path):
        return False
    with os.scandir(path) as entries:
        return any(e.name.endswith(".safetensors") for e in entries)


class _Current(threading.local):
    load: _Load | None = None


_current = _Current()


def _load_model(original: Callable[..., Any]) -> Callable[..., Any]:
    """The model's load from the start: the request goes out before the model is built."""

    @functools.wraps(original)
    def load_model(self: Any, vllm_config: Any, model_config: Any, *args: Any, **kw: Any) -> Any:
        if _why_not(self.load_config) is not None:
            return original(self, vllm_config, model_config, *args, **kw)
        load = _Load(self, model_config, vllm_config)
        _current.load = load
        try:
            load.start_early()
            return original(self, vllm_config, model_config, *args, **kw)
        finally:
            _current.load = None
            load.end()

    return load_model


def _load_weights(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def load_weights(self: Any, model: Any, model_config: Any) -> Any:
        why_not = _why_not(self.load_config)
        if why_not is not None:
            _SERVER.say_once(why_not)
            return original(self, model, model_config)
        load = _current.load
        if load is None or load.loader is not self or load.loading or load.model is not None:
            load = _Load(self, model_config)  # weights loaded into a built model (a reload)
        load.model, load.loading = model, True
        previous, _current.load = _current.load, load
        try:
            return original(self, model, model_config)
        finally:
            _current.load = previous
            load.loading = False
            load.end()
            if not load.started:
                _SERVER.say_once("no safetensors files in this load: spanwarm warms nothing")

    return load_weights


def _why_not(load_config: Any) -> str | None:
    try:
        return _not_warmed(load_config)
    except Exception as exc:
        return f"its load settings are unknown to spanwarm ({exc})"


def _gated_iterator(
    original: Callable[..., Iterator[tuple[str, torch.Tensor]]],
    sort_key: Callable[[str], Any],
    skip: Callable[[str, set[int] | None], bool],
) -> Callable[..., Iterator[tuple[str, torch.Tensor]]]:
    @functools.wraps(original)
    def safetensors_weights_iterator(
        hf_weights_files: list[str],
        use_tqdm_on_load: bool,
        safetensors_load_strategy: str | None = None,
        local_expert_ids: set[int] | None = None,
        **kwargs: Any,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        if in_dry_run():
            yield from meta_weights(hf_weights_files, local_expert_ids, sort_key, skip)
            return
        load = _current.load
        if load is not None and not load.loading:
            load = None  # not within this load's load_weights
        gate = load.start() if load is not None and safetensors_load_strategy in _LAZY else None
        # With spanwarm's request out, vLLM's own prefetch would read whole files beside it;
        # with no daemon there to answer it, vLLM's prefetch (automatic on NFS) stays.
        present = load is not None and gate is not None and load.daemon_present()
        strategy = "lazy" if present else safetensors_load_strategy
        weights = original(hf_weights_files, use_tqdm_on_load, strategy, local_expert_ids, **kwargs)
        if gate is None:
            yield from weights
            return
        # get_tensor reads a tensor's first page as it hands it out: wait for the tensor
        # the dry run says comes next before asking the iterator for it.
        expected = load.upcoming if load is not None else iter(())
        weights = iter(weights)
        while True:
            upcoming = next(expected, None)
            if upcoming is not None:
                gate.before_read(upcoming)
            try:
                name, tensor = next(weights)
            except StopIteration:
                return
            if name != upcoming:  # out of step with the dry run: wait for this one
                gate.before_read(name)
            yield name, tensor
            gate.after_read(name)  # the weight loaders have copied it: they ask for the next

    return safetensors_weights_iterator


def _not_warmed(load_config: Any) -> str | None:
    """Why spanwarm warms nothing for a default-loader load with these settings (None:
    it does)."""
    load_format = str(getattr(load_config, "load_format", "auto"))
    load_format = getattr(load_config.load_format, "value", load_format)
    extra = getattr(load_config, "model_loader_extra_config", None) or {}
    strategy = getattr(load_config, "safetensors_load_strategy", None)
    if load_format not in ("auto", "safetensors", "hf", "mistral"):
        return f"load format {load_format!r} reads through its own reader: spanwarm warms nothing"
    if extra.get("enable_multithread_load"):
        return "multithreaded loading reads whole files: spanwarm warms nothing"
    if strategy not in _LAZY:
        return (
            f"safetensors load strategy {strategy!r} reads whole files itself: "
            "spanwarm warms nothing"
        )
    return None


def _say_what_other_loaders_get(
    original: Callable[..., None], default_class: type
) -> Callable[..., None]:
    @functools.wraps(original)
    def __init__(self: Any, load_config: Any, *args: Any, **kwargs: Any) -> None:
        original(self, load_config, *args, **kwargs)
        if not isinstance(self, default_class):
            fmt = getattr(load_config, "load_format", "?")
            _SERVER.say_once(
                f"load format {fmt!r} ({type(self).__name__}) reads through its own "
                "reader: spanwarm warms nothing"
            )

    return __init__
