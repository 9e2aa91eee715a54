"""Hooks into ``from_pretrained``: request this rank's spans, then wait per tensor.

Two transformers internals are wrapped (transformers 5.x, ``modeling_utils``):

- ``PreTrainedModel._load_pretrained_model(model, state_dict, checkpoint_files, ...)`` runs
  after the model is distributed on meta and before any weight byte is read: its
  ``model.state_dict()`` carries the final placements. The spans are requested there.
- ``convert_and_load_state_dict_in_model(model, state_dict, ...)`` receives the lazy
  safetensors slices; each is wrapped so that the read waits for that tensor's readiness,
  then reports it consumed (which moves the daemon's memory budget window along).

A load that is not distributed, passes its own state dict or reads no safetensors is
left alone, and so is everything when the daemon is absent (the ticket is released).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import threading
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from spanwarm.checkpoint.resolve import open_checkpoint
from spanwarm.checkpoint.tensor_layout import TensorSpans, stored_tensor_spans
from spanwarm.client.client import Client
from spanwarm.integrations.gate import GatedReads
from spanwarm.integrations.transformers.routing import REQUIRED, load_spans

__all__ = ["LoadRecord", "Prefetch", "disable", "enable", "prefetch"]

logger = logging.getLogger("spanwarm.transformers")

_CONVERT = "convert_and_load_state_dict_in_model"
_DCP_LOAD = "_load_and_finalize_distributed_pretrained_model"
_HOOKED = {**REQUIRED, "transformers.modeling_utils": ("PreTrainedModel", _CONVERT)}


@dataclass
class LoadRecord(GatedReads):
    """One ``from_pretrained`` that spanwarm prefetched for."""

    files: list[str] = field(default_factory=list, kw_only=True)
    whole_files: bool = field(default=False, kw_only=True)
    """``disable_mmap`` or an hf-mount: transformers reads every file whole, not through
    slices; the daemon's reads then run ahead of it, file by file, with nothing to wait on."""


class _WaitingSlice:
    """A safetensors slice whose reads wait for the daemon to have warmed it."""

    __slots__ = ("_name", "_record", "_slice")

    def __init__(self, source: Any, name: str, record: LoadRecord) -> None:
        self._slice = source
        self._name = name
        self._record = record

    def __getitem__(self, index: Any) -> Any:
        self._record.before_read(self._name)
        try:
            return self._slice[index]
        finally:
            self._record.after_read(self._name)

    def __getattr__(self, attr: str) -> Any:  # get_shape, get_dtype, ...
        return getattr(self._slice, attr)


class Prefetch:
    """The installed integration; ``loads`` lists what each hooked load requested."""

    def __init__(
        self, client: Client | None, job: str | None, wait_timeout: float | None, active: bool
    ) -> None:
        self.client = client or Client()
        self.job = job
        self.wait_timeout = wait_timeout
        self.active = active
        self.loads: list[GatedReads] = []
        """What each load requested: a :class:`LoadRecord` per safetensors load, a
        :class:`~spanwarm.integrations.dcp.DcpLoad` per distributed-checkpoint one."""

    def start(
        self, model: Any, state_dict: Any, checkpoint_files: Sequence[str] | None, load_config: Any
    ) -> LoadRecord | None:
        """Request this rank's spans for a load about to start; None if it is not ours (or
        anything in here fails: one warning, and the load goes on cold)."""
        try:
            if not self.active or state_dict is not None or not checkpoint_files:
                return None
            if not all(str(f).endswith(".safetensors") for f in checkpoint_files):
                return None
            if getattr(model.config, "distributed_config", None) is None:
                return None
            whole_files = _reads_whole_files(checkpoint_files, load_config)
            spans = _load_spans(model, checkpoint_files, load_config, whole_files)
            ticket = self.client.request(spans, job=self.job)
        except Exception as exc:  # never fail a load over a prefetch
            logger.warning("spanwarm: cannot plan this load (%s); loading without prefetch", exc)
            return None
        record = LoadRecord(
            spans,
            ticket,
            self.wait_timeout,
            files=[str(f) for f in checkpoint_files],
            whole_files=whole_files,
        )
        self.loads.append(record)
        return record


def _reads_whole_files(files: Sequence[str], load_config: Any) -> bool:
    """transformers reads whole files, not slices, with ``disable_mmap`` or on an hf-mount."""
    from transformers import modeling_utils

    on_hf_mount = getattr(modeling_utils, "_is_on_hf_mount", lambda path: False)
    return bool(getattr(load_config, "disable_mmap", False)) or any(map(on_hf_mount, files))


def _reads_by_target(load_config: Any) -> bool:
    """transformers' conditions for loading without its thread pool (then it reads target
    by target instead of in checkpoint-key order)."""
    from transformers.utils.import_utils import is_env_variable_true

    device_map = getattr(load_config, "device_map", None) or {"": "cpu"}
    quantizer = getattr(load_config, "hf_quantizer", None)
    return (
        is_env_variable_true("HF_DEACTIVATE_ASYNC_LOAD")
        or "disk" in device_map.values()
        or (quantizer is not None and not quantizer.pre_quantized)
    )


def _load_spans(
    model: Any, files: Sequence[str], load_config: Any, whole_files: bool
) -> list[TensorSpans]:
    checkpoint = open_checkpoint(files)
    if whole_files:  # whole files, in the order transformers reads them
        return [
            s
            for header in checkpoint.headers
            for t in sorted(header.tensors, key=lambda t: t.begin)
            for s in stored_tensor_spans(t.name, [(header, t)], None)
        ]
    return load_spans(
        model,
        checkpoint,
        getattr(load_config, "weight_mapping", None),
        by_target=_reads_by_target(load_config),
        first_pages=True,  # each slice faults its tensor's first page
    )


_state = threading.local()
_installed: Prefetch | None = None
_install_lock = threading.Lock()
_originals: dict[str, Any] = {}
_warned = False


def _missing_internals() -> list[str]:
    try:
        import transformers
    except ImportError:
        return ["the transformers package"]
    if int(transformers.__version__.split(".")[0]) < 5:
        return [f"transformers>=5 (found {transformers.__version__})"]
    missing = []
    for module_name, names in _HOOKED.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            missing.append(module_name)
            continue
        missing += [f"{module_name}.{n}" for n in names if not hasattr(module, n)]
    if not missing:
        from transformers.modeling_utils import PreTrainedModel

        hook = inspect.getattr_static(PreTrainedModel, "_load_pretrained_model", None)
        if not isinstance(hook, staticmethod):
            missing.append("PreTrainedModel._load_pretrained_model (a staticmethod)")
    return missing


def _install() -> None:
    from transformers import modeling_utils
    from transformers.modeling_utils import PreTrainedModel

    load = inspect.getattr_static(PreTrainedModel, "_load_pretrained_model").__func__
    convert = getattr(modeling_utils, _CONVERT)
    convert_signature = inspect.signature(convert)

    def load_pretrained_model(
        model: Any, state_dict: Any, checkpoint_files: Any, load_config: Any, *a: Any, **kw: Any
    ) -> Any:
        session = _installed
        record = (
            session.start(model, state_dict, checkpoint_files, load_config) if session else None
        )
        if record is None:
            return load(model, state_dict, checkpoint_files, load_config, *a, **kw)
        _state.record = record
        try:
            return load(model, state_dict, checkpoint_files, load_config, *a, **kw)
        finally:
            _state.record = None
            try:
                record.ticket.cancel()  # the load is over: release whatever it still holds
            except Exception as exc:  # the load's own outcome stands
                logger.warning("spanwarm: ending the request: %s", exc)

    def convert_and_load(*args: Any, **kwargs: Any) -> Any:
        record: LoadRecord | None = getattr(_state, "record", None)
        if record is not None and not record.whole_files:
            try:
                bound = convert_signature.bind(*args, **kwargs)
                requested = {s.tensor for s in record.spans}
                bound.arguments["state_dict"] = {
                    name: _WaitingSlice(value, name, record)
                    if name in requested and hasattr(value, "get_shape")  # lazy slices only
                    else value
                    for name, value in bound.arguments["state_dict"].items()
                }
                args, kwargs = bound.args, bound.kwargs
            except Exception as exc:  # a changed signature: load unwaited, never fail
                logger.warning("spanwarm: cannot wait per tensor (%s); loading unwaited", exc)
        return convert(*args, **kwargs)

    _originals["load"] = inspect.getattr_static(PreTrainedModel, "_load_pretrained_model")
    _originals["convert"] = convert
    _install_distributed_checkpoints(PreTrainedModel)
    PreTrainedModel._load_pretrained_model = staticmethod(load_pretrained_model)  # type: ignore[method-assign]
    setattr(modeling_utils, _CONVERT, convert_and_load)


def enable(
    client: Client | None = None, *, job: str | None = None, wait_timeout: float | None = 300.0
) -> Prefetch:
    """Make every distributed ``from_pretrained`` in this process prefetch through the node's
    daemon; returns the installed :class:`Prefetch` (inactive, after one warning, when
    transformers lacks an internal this relies on). When already enabled, the installed
    one is returned unchanged: :func:`disable` first to change its client or settings."""
    with _install_lock:
        return _enable(client, job, wait_timeout)


def _enable(client: Client | None, job: str | None, wait_timeout: float | None) -> Prefetch:
    global _installed, _warned
    if _installed is not None:
        return _installed
    missing = _missing_internals()
    if missing:
        if not _warned:
            warnings.warn(
                "spanwarm: transformers integration disabled, not found: "
                + ", ".join(missing)
                + "; from_pretrained loads without prefetch",
                RuntimeWarning,
                stacklevel=2,
            )
            _warned = True
        return Prefetch(client, job, wait_timeout, active=False)
    prefetch = Prefetch(client, job, wait_timeout, active=True)
    _install()
    _installed = prefetch
    return prefetch


def disable() -> None:
    """Undo :func:`enable`: transformers' own functions are put back."""
    with _install_lock:
        _disable()


def _install_distributed_checkpoints(model_class: Any) -> None:
    """A directory written by ``save_pretrained(..., distributed_checkpoint=True)`` loads
    through ``_load_and_finalize_distributed_pretrained_model``: one ``dcp.load`` with
    ``HuggingFaceStorageReader`` of the model's (redistributed) state dict. That load
    reads through :class:`~spanwarm.integrations.dcp.PrefetchReader`, in this thread only."""
    load_distributed = getattr(model_class, _DCP_LOAD, None)
    if load_distributed is None:  # older transformers: no distributed checkpoints
        return

    def prefetched(model: Any, checkpoint_dir: Any, *args: Any, **kwargs: Any) -> Any:
        session = _installed
        if session is None or not session.active:
            return load_distributed(model, checkpoint_dir, *args, **kwargs)
        from spanwarm.integrations.dcp import hooks

        readers = hooks.Prefetch(session.client, session.job, session.wait_timeout)
        try:
            with hooks.scoped(readers):
                return load_distributed(model, checkpoint_dir, *args, **kwargs)
        finally:
            session.loads.extend(load for reader in readers.readers for load in reader.loads)

    _originals["dcp"] = model_class.__dict__.get(_DCP_LOAD)  # None: inherited (a mixin's)
    setattr(model_class, _DCP_LOAD, prefetched)


def _disable() -> None:
    global _installed
    if _installed is None:
        return
    from transformers import modeling_utils
    from transformers.modeling_utils import PreTrainedModel

    PreTrainedModel._load_pretrained_model = _originals.pop("load")  # type: ignore[method-assign]
    setattr(modeling_utils, _CONVERT, _originals.pop("convert"))
    if "dcp" in _originals:
        own = _originals.pop("dcp")
        if own is None:
            delattr(PreTrainedModel, _DCP_LOAD)
        else:
            setattr(PreTrainedModel, _DCP_LOAD, own)
    _installed = None


@contextmanager
def prefetch(
    client: Client | None = None, *, job: str | None = None, wait_timeout: float | None = 300.0
) -> Iterator[Prefetch]:
    """:func:`enable` for the ``with`` block only."""
    installed_before = _installed is not None
    session = enable(client, job=job, wait_timeout=wait_timeout)
    try:
        yield session
    finally:
        if not installed_before:
            disable()
