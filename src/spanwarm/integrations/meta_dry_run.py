"""A rank's exact reads of a safetensors checkpoint, known before any byte is read: the
dry run every inference-server integration shares (:mod:`spanwarm.integrations.vllm`,
:mod:`spanwarm.integrations.sglang`).

An integration builds a second model on the meta device with the rank's own
configuration (:class:`WeightsOnMeta`), and runs its ``load_weights`` over meta tensors
made from the safetensors headers (:func:`meta_weights`, which the integration's hooked
safetensors iterator yields while :func:`in_dry_run`), under
:class:`~spanwarm.integrations.touches.TouchRecorder` (:func:`dry_run`). A second model
rather than the real one: a loader with side effects (online quantization, layer-wise
processing) must not run twice on the weights that are served.

The iterators' ``get_tensor`` reads each tensor's first byte as it hands it out (a view of
the file's mapping is made so, as for ``get_slice``, see :mod:`spanwarm.client.first_pages`):
the page of it is read even for an expert the weight loaders then pass over, and it is
asked for too.

Where the dry run cannot run (a dtype meta tensors lack, an op meta tensors do not
support, its time budget spent), the answer is coarser and still safe: every tensor the
iterator will hand out, whole.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from spanwarm.checkpoint.safetensors_header import Header, read_header
from spanwarm.checkpoint.tensor_layout import TensorSpans
from spanwarm.client.first_pages import first_page_span
from spanwarm.integrations.touches import TouchRecorder, spans_of

__all__ = [
    "DryRun",
    "DryRunUnsupported",
    "HandedOut",
    "WeightsOnMeta",
    "budget_from_environment",
    "dry_run",
    "in_dry_run",
    "meta_weights",
    "swapped",
    "whole_tensors",
]

_HEADER_THREADS = 16  # header reads at once (each a round trip on network storage)

_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "C64": torch.complex64,
}
# Named where this torch has them (safetensors' own map has them too).
for _name, _attr in (
    ("F8_E4M3FNUZ", "float8_e4m3fnuz"),
    ("F8_E5M2FNUZ", "float8_e5m2fnuz"),
    ("F8_E8M0", "float8_e8m0fnu"),
):
    if hasattr(torch, _attr):
        _DTYPES[_name] = getattr(torch, _attr)


class DryRunUnsupported(Exception):
    """The dry run cannot tell this load's reads (the coarse answer applies)."""


@dataclass(frozen=True, slots=True)
class HandedOut:
    """One tensor the iterator hands out: its checkpoint name, file and header entry."""

    name: str
    header: Header
    index: int  # position in header.tensors


@dataclass
class DryRun:
    """What a rank will read: ``spans`` grouped by tensor, in the order tensors are handed
    out, and how they were found (``exact``: by the dry run; else whole tensors)."""

    spans: list[TensorSpans]
    handed_out: list[HandedOut] = field(default_factory=list)
    exact: bool = True
    seconds: float = 0.0
    reason: str = ""  # why the answer is whole tensors


class _State(threading.local):
    recorder: TouchRecorder | None = None
    handed_out: list[HandedOut] | None = None
    deadline: float = float("inf")
    unsupported: str = ""  # why the dry run stopped, even where a loader caught it


_state = _State()


def in_dry_run() -> bool:
    return _state.handed_out is not None


def meta_weights(
    files: list[str],
    local_expert_ids: set[int] | None = None,
    sort_key: Callable[[str], Any] | None = None,
    skip: Callable[[str, set[int] | None], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """A lazy safetensors iterator (``safe_open(...).get_tensor`` of each key), with meta
    tensors from the headers for its views: the files sorted by ``sort_key`` (None: in
    the order given), each file's keys sorted, those ``skip`` names left out."""
    assert _state.handed_out is not None
    ordered = list(files) if sort_key is None else sorted(files, key=sort_key)
    # All headers at once: on network storage each read is a round trip (a seek), and
    # the dry run's time is the load's, ahead of the model's build.
    with ThreadPoolExecutor(max(1, min(_HEADER_THREADS, len(ordered)))) as pool:
        headers = list(pool.map(read_header, ordered))
    for path, header in zip(ordered, headers, strict=True):
        position = {t.name: i for i, t in enumerate(header.tensors)}
        # safe_open(...).keys(), the iterators' order, is the names sorted (by UTF-8 bytes,
        # which is code point order): taken from the one parse, not a second read of it.
        for name in sorted(position):
            if skip is not None and skip(name, local_expert_ids):
                continue
            info = header.tensors[position[name]]
            _state.handed_out.append(HandedOut(name, header, position[name]))
            recorder = _state.recorder
            dtype = _DTYPES.get(info.dtype)
            if recorder is None:  # only listing what is handed out: any stand-in does
                yield name, torch.empty((0,), dtype=dtype or torch.uint8, device="meta")
                continue
            if time.monotonic() > _state.deadline:
                _state.unsupported = "its time budget was spent"
            elif dtype is None:
                _state.unsupported = f"{path}: {name} has dtype {info.dtype}"
            if _state.unsupported:
                raise DryRunUnsupported(_state.unsupported)
            tensor = torch.empty(info.shape, dtype=dtype, device="meta")
            yield name, recorder.hand_out((header.path, name), tensor)


def dry_run(
    load: Callable[[], object], weights: Callable[[], Iterable[object]], *, budget_s: float
) -> DryRun:
    """Run ``load`` (a meta model's ``load_weights`` over the loader's weights, whose
    safetensors iterator yields :func:`meta_weights`) and return the spans it read; where
    it cannot tell, every tensor ``weights()`` (the same iterator) hands out, whole."""
    began = time.monotonic()
    recorder = TouchRecorder()
    try:
        with _dry(recorder, began + budget_s) as handed_out, recorder:
            load()
            if _state.unsupported:  # raised in the iterator, and caught by a loader
                raise DryRunUnsupported(_state.unsupported)
    except Exception as exc:
        reason = str(exc) if isinstance(exc, DryRunUnsupported) else f"{type(exc).__name__}: {exc}"
        try:
            with _dry(None, float("inf")) as handed_out:
                for _ in weights():
                    pass
        except Exception as again:
            reason += f"; listing the tensors failed too ({type(again).__name__}: {again})"
            raise DryRunUnsupported(reason) from again
        return DryRun(
            whole_tensors(handed_out),
            handed_out,
            exact=False,
            seconds=time.monotonic() - began,
            reason=reason,
        )
    regions = recorder.regions()
    spans: list[TensorSpans] = []
    seen: set[tuple[str, str]] = set()
    for item in handed_out:
        key = (item.header.path, item.name)  # a name may repeat in another file
        if key in seen:
            continue
        seen.add(key)
        info = item.header.tensors[item.index]
        begin = item.header.file_offset(info)
        read = [
            TensorSpans(item.name, item.header.path, begin + off, length, stride, count)
            for off, length, stride, count in spans_of(regions.get(key, []))
        ]
        # get_tensor (safetensors 0.8) reads the tensor's first byte as it hands it out.
        lowest = min((s.offset for s in read), default=None)
        end = item.header.data_start + info.end
        touch = first_page_span(item.name, item.header.path, begin, end, lowest)
        spans.extend(read if touch is None else [touch, *read])
    return DryRun(spans, handed_out, exact=True, seconds=time.monotonic() - began)


@contextlib.contextmanager
def _dry(recorder: TouchRecorder | None, deadline: float) -> Iterator[list[HandedOut]]:
    """In this thread, the safetensors iterator yields :func:`meta_weights` meanwhile."""
    handed_out: list[HandedOut] = []
    _state.handed_out, _state.recorder, _state.deadline = handed_out, recorder, deadline
    _state.unsupported = ""
    try:
        yield handed_out
    finally:
        _state.handed_out, _state.recorder, _state.deadline = None, None, float("inf")
        _state.unsupported = ""


def whole_tensors(handed_out: list[HandedOut]) -> list[TensorSpans]:
    out: list[TensorSpans] = []
    seen: set[tuple[str, str]] = set()
    for item in handed_out:
        info = item.header.tensors[item.index]
        if (item.header.path, item.name) in seen or info.nbytes == 0:
            continue
        seen.add((item.header.path, item.name))
        out.append(
            TensorSpans(
                item.name,
                item.header.path,
                item.header.file_offset(info),
                info.nbytes,
                info.nbytes,
                1,
            )
        )
    return out


# Tensor factories a model's constructor calls (with or without a device).
_FACTORIES = {
    torch.empty,
    torch.zeros,
    torch.ones,
    torch.full,
    torch.arange,
    torch.empty_strided,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.linspace,
    torch.eye,
    torch.tensor,
    torch.as_tensor,
}
# A tensor of at most this many elements that is not floating point (an expert map, an
# index table), or that is built from values (torch.tensor), is made for real.
_REAL_ELEMENTS = 2**20


class WeightsOnMeta(TorchFunctionMode):
    """While a model is built: tensors go to the meta device, except small index tables
    and tensors built from given values. A weight loader consults those (which experts
    are local: ``expert_map[e].item()``), and on meta they have no values."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func not in _FACTORIES:
            return func(*args, **kwargs)
        kwargs["device"] = "meta"
        if func in (torch.tensor, torch.as_tensor):
            real = func(*args, **{**kwargs, "device": "cpu"})
            return real if real.numel() <= _REAL_ELEMENTS else real.to("meta")
        made = func(*args, **kwargs)
        if made.dtype.is_floating_point or made.numel() > _REAL_ELEMENTS:
            return made
        return func(*args, **{**kwargs, "device": "cpu"})


def budget_from_environment(variable: str, default: float = 60.0) -> float:
    """Seconds a dry run may take, from ``variable`` (``default`` where unset or invalid)."""
    try:
        return max(0.0, float(os.environ.get(variable, str(default))))
    except ValueError:
        return default


@contextlib.contextmanager
def swapped(
    module_name: str, name: str, empty: Callable[[], dict[Any, Any]] = dict
) -> Iterator[None]:
    """``module_name.name`` (a dict) is a fresh, empty one (``empty()``) meanwhile: a
    module-level cache of layers a twin must neither use nor fill. Nothing where the
    module is missing."""
    import importlib

    try:
        module = importlib.import_module(module_name)
    except ImportError:
        yield
        return
    saved = getattr(module, name, None)
    if not isinstance(saved, dict):
        yield
        return
    setattr(module, name, empty())
    try:
        yield
    finally:
        setattr(module, name, saved)
