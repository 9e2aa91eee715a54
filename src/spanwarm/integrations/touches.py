"""What a ``load_weights`` call reads of each tensor it is handed: a dry run on meta tensors.

An inference server's weight loaders get zero-copy views of the checkpoint's mapping and
read only the part each parameter copies: ``narrow``, ``chunk``, ``select`` or indexing
make a view, and the first op that is not a view (``copy_``, ``cat``, ``to``, an
assignment) consumes that view's elements. Meta tensors keep a view's geometry (storage
offset, sizes, strides) without any data, so running the loaders over meta tensors of the
checkpoint's shapes under :class:`TouchRecorder` names the exact elements each would read,
before a byte is read. In-place ops on them (``param.copy_(view)``, an assignment) are
recorded and not run: the destination may be a real tensor of the model.

A handed-out tensor and its views share one storage; the recorder keys them by it, so a
view of a view, ``.data`` and ``.detach()`` are followed as well. Where a loader asks for
a value (``item()``, ``tolist()``, ``bool()``), the region is recorded and a stand-in of
one is returned: the rest of the dry run goes on (a branch on that value may then differ
from the real load's; the elements read before it are still exact).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

__all__ = ["Region", "TouchRecorder", "region_spans"]

# A region of more than this many strided spans is recorded as its envelope instead.
_MAX_SPANS_PER_REGION = 4096
# Values a loader can ask of a tensor: recorded, answered with a stand-in on meta.
_VALUES: dict[Any, Callable[[torch.Tensor], Any]] = {
    torch.Tensor.item: lambda t: 1.0 if t.dtype.is_floating_point else 1,
    torch.Tensor.tolist: lambda t: torch.ones(t.shape, dtype=torch.int64).tolist(),
    torch.Tensor.__bool__: lambda t: True,
    torch.Tensor.__int__: lambda t: 1,
    torch.Tensor.__float__: lambda t: 1.0,
    torch.Tensor.__index__: lambda t: 1,
}
# What reads no element: shape and layout queries (property getters are caught by name).
_METADATA = {
    torch.Tensor.size,
    torch.Tensor.dim,
    torch.Tensor.numel,
    torch.Tensor.stride,
    torch.Tensor.storage_offset,
    torch.Tensor.is_contiguous,
    torch.Tensor.element_size,
    torch.Tensor.__len__,
    torch.Tensor.untyped_storage,
    torch.Tensor.data_ptr,
    torch.Tensor.get_device,
    torch.Tensor.is_floating_point,
    torch.Tensor.is_complex,
}


@dataclass(frozen=True, slots=True)
class Region:
    """Elements of a handed-out tensor, in its bytes: ``offset`` of the first element,
    ``sizes`` and ``strides`` (bytes) of the view, ``itemsize`` of its dtype."""

    offset: int
    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    itemsize: int


@dataclass
class _Handed:
    name: Hashable
    tensor: torch.Tensor  # kept alive: its storage's id must not be reused
    regions: list[Region] = field(default_factory=list)


class TouchRecorder(TorchFunctionMode):
    """Records, per handed-out tensor, the regions ops that are not views consume."""

    def __init__(self) -> None:
        super().__init__()
        self._by_storage: dict[int, _Handed] = {}
        self.order: list[Hashable] = []  # tensors in the order they were handed out

    def hand_out(self, name: Hashable, tensor: torch.Tensor) -> torch.Tensor:
        """Follow ``tensor`` (a fresh, contiguous meta tensor) as the tensor ``name``
        names (a checkpoint key, or the file and key where names repeat across files)."""
        handed = _Handed(name, tensor)
        self._by_storage[_storage_id(tensor)] = handed
        self.order.append(name)
        return tensor

    def regions(self) -> dict[Hashable, list[Region]]:
        """The regions consumed of each tensor handed out (several hand-outs add up)."""
        out: dict[Hashable, list[Region]] = {}
        for handed in self._by_storage.values():
            out.setdefault(handed.name, []).extend(handed.regions)
        return out

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in _METADATA or getattr(func, "__name__", "") == "__get__":
            return func(*args, **kwargs)  # .data, .T, .mT: views, followed by storage
        followed = [
            (t, handed)
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor) and (handed := self._handed(t)) is not None
        ]
        if not followed:
            return func(*args, **kwargs)
        stand_in = _VALUES.get(func)
        if stand_in is not None:
            self._record(followed)
            return stand_in(followed[0][0])
        if _in_place(func):  # a write into a parameter: read its source, write nothing
            self._record(followed)
            return args[0] if args else None
        result = func(*args, **kwargs)
        if not _is_view_of(result, followed):
            self._record(followed)
        return result

    def _handed(self, tensor: torch.Tensor) -> _Handed | None:
        if tensor.device.type != "meta":
            return None
        return self._by_storage.get(_storage_id(tensor))

    @staticmethod
    def _record(followed: list[tuple[torch.Tensor, _Handed]]) -> None:
        for t, handed in followed:
            itemsize = t.element_size()
            handed.regions.append(
                Region(
                    offset=int(t.storage_offset()) * itemsize,
                    sizes=tuple(int(n) for n in t.shape),
                    strides=tuple(int(s) * itemsize for s in t.stride()),
                    itemsize=itemsize,
                )
            )


def _in_place(func: Any) -> bool:
    name = getattr(func, "__name__", "")
    return name == "__setitem__" or (name.endswith("_") and not name.endswith("__"))


def _storage_id(tensor: torch.Tensor) -> int:
    return int(tensor.untyped_storage()._cdata)


def _is_view_of(result: Any, followed: list[tuple[torch.Tensor, _Handed]]) -> bool:
    """Whether every tensor ``result`` holds shares a followed tensor's storage (a view,
    or the tensor itself: ``to`` and ``contiguous`` return their input where they can)."""
    tensors = [t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)]
    if not tensors:
        return False
    storages = {_storage_id(t) for t, _ in followed}
    return all(t.device.type == "meta" and _storage_id(t) in storages for t in tensors)


def region_spans(region: Region) -> list[tuple[int, int, int, int]]:
    """The bytes of ``region`` as ``(offset, length, stride, count)`` strided spans,
    relative to the tensor's first byte: contiguous dims coalesced, the next one as the
    stride, any further out enumerated (past ``_MAX_SPANS_PER_REGION``, the envelope)."""
    if any(n == 0 for n in region.sizes):
        return []
    # Broadcast (stride 0) and single-element dims add no bytes.
    dims = sorted((s, n) for n, s in zip(region.sizes, region.strides, strict=True) if n > 1 and s)
    run = region.itemsize
    while dims and dims[0][0] == run:
        run *= dims.pop(0)[1]
    if not dims:
        return [(region.offset, run, run, 1)]
    stride, count = dims.pop(0)
    outer = dims
    overlapping = stride < run or any(s < stride * count for s, _ in outer[:1])
    spans_needed = 1
    for _, n in outer:
        spans_needed *= n
    if overlapping or spans_needed > _MAX_SPANS_PER_REGION:
        return [_envelope(region)]
    out = []
    for steps in itertools.product(*(range(n) for _, n in outer)):
        start = region.offset + sum(i * s for i, (s, _) in zip(steps, outer, strict=True))
        out.append((start, run, stride, count))
    return out


def _envelope(region: Region) -> tuple[int, int, int, int]:
    last = sum((n - 1) * s for n, s in zip(region.sizes, region.strides, strict=True))
    length = last + region.itemsize
    return (region.offset, length, length, 1)


def spans_of(regions: list[Region]) -> Iterator[tuple[int, int, int, int]]:
    """Every region's spans, each distinct span once."""
    seen: set[tuple[int, int, int, int]] = set()
    for region in regions:
        for span in region_spans(region):
            if span not in seen:
                seen.add(span)
                yield span
