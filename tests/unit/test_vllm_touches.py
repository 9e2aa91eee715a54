"""The dry run's recorder on meta tensors, against the same views of real tensors.

A real base tensor holding its own element indices (``arange``) tells, through any chain
of views, which elements the view covers: its values. The recorder sees only the meta
twin's geometry; both must name the same bytes.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

pytest.importorskip("torch")

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spanwarm.integrations.vllm.touches import (
    Region,
    TouchRecorder,
    region_spans,
    spans_of,
)

View = Callable[[torch.Tensor], torch.Tensor]


def span_bytes(spans: list[tuple[int, int, int, int]]) -> set[int]:
    out: set[int] = set()
    for offset, length, stride, count in spans:
        for row in range(count):
            out.update(range(offset + row * stride, offset + row * stride + length))
    return out


def real_bytes(shape: tuple[int, ...], view: View, itemsize: int = 2) -> set[int]:
    """The bytes of the elements ``view`` takes of a contiguous tensor of ``shape``."""
    numel = 1
    for n in shape:
        numel *= n
    indices = view(torch.arange(numel).reshape(shape))
    return {int(i) * itemsize + k for i in indices.flatten().tolist() for k in range(itemsize)}


def recorded_bytes(shape: tuple[int, ...], view: View) -> set[int]:
    """What the recorder says a copy of ``view`` of a meta bf16 tensor reads."""
    recorder = TouchRecorder()
    base = torch.empty(shape, dtype=torch.bfloat16, device="meta")
    with recorder:
        handed = recorder.hand_out("w", base)
        sliced = view(handed)
        dest = torch.empty(sliced.shape, dtype=torch.bfloat16, device="meta")
        dest.copy_(sliced)
    return span_bytes(list(spans_of(recorder.regions().get("w", []))))


VIEWS: dict[str, tuple[tuple[int, ...], View]] = {
    "rows (column-parallel)": ((8, 6), lambda t: t.narrow(0, 2, 3)),
    "columns (row-parallel)": ((8, 6), lambda t: t.narrow(1, 3, 3)),
    "chunk": ((8, 6), lambda t: t.chunk(4, dim=0)[2]),
    "select": ((4, 5, 6), lambda t: t.select(1, 2)),
    "index": ((4, 5, 6), lambda t: t[1:3, :, 2:4]),
    "transpose then rows": ((6, 8), lambda t: t.t().narrow(0, 1, 2)),
    "expert of a stack": ((4, 6, 8), lambda t: t[2]),
    "whole": ((3, 4), lambda t: t),
    "a single element": ((3, 4), lambda t: t[1, 2]),
    "strided step": ((12, 4), lambda t: t[::3]),
    "reshape of rows": ((8, 6), lambda t: t.narrow(0, 2, 4).reshape(2, 12)),
}


@pytest.mark.parametrize("name", list(VIEWS))
def test_recorded_bytes_are_the_views_elements(name: str) -> None:
    shape, view = VIEWS[name]
    assert recorded_bytes(shape, view) == real_bytes(shape, view)


@settings(max_examples=200, deadline=None)
@given(
    shape=st.lists(st.integers(1, 6), min_size=1, max_size=4).map(tuple),
    data=st.data(),
)
def test_any_chain_of_narrows_and_selects(shape: tuple[int, ...], data: st.DataObject) -> None:
    steps: list[tuple[str, int, int, int]] = []
    dims = list(shape)
    for _ in range(data.draw(st.integers(0, 3))):
        if not dims:
            break
        dim = data.draw(st.integers(0, len(dims) - 1))
        if data.draw(st.booleans()) and len(dims) > 1:
            index = data.draw(st.integers(0, dims[dim] - 1))
            steps.append(("select", dim, index, 0))
            dims.pop(dim)
        else:
            start = data.draw(st.integers(0, dims[dim] - 1))
            length = data.draw(st.integers(1, dims[dim] - start))
            steps.append(("narrow", dim, start, length))
            dims[dim] = length

    def view(t: torch.Tensor) -> torch.Tensor:
        for op, dim, a, b in steps:
            t = t.select(dim, a) if op == "select" else t.narrow(dim, a, b)
        return t

    assert recorded_bytes(shape, view) == real_bytes(shape, view)


def test_views_alone_read_nothing_and_values_get_a_stand_in() -> None:
    recorder = TouchRecorder()
    with recorder:
        w = recorder.hand_out("w", torch.empty(4, 8, dtype=torch.float32, device="meta"))
        halves = w.chunk(2, dim=1)  # views: nothing read yet
        _ = w.shape, w.dtype, w.stride(), w.data, w.t()
        assert recorder.regions()["w"] == []
        scale = recorder.hand_out("scale", torch.empty((), dtype=torch.float32, device="meta"))
        assert scale.item() == 1.0  # recorded, answered with a stand-in on meta
        assert recorder.regions()["scale"] == [Region(0, (), (), 4)]
        total = torch.cat([halves[1], halves[1]])  # a copy: reads its sources
    assert span_bytes(list(spans_of(recorder.regions()["w"]))) == {
        row * 32 + 16 + k for row in range(4) for k in range(16)
    }
    assert total.device.type == "meta"


def test_writes_into_real_tensors_are_recorded_not_run() -> None:
    """A loader may copy into a real tensor (a scale kept on the host): the dry run reads
    the source and writes nothing."""
    real = torch.zeros(2, 3)
    recorder = TouchRecorder()
    with recorder:
        w = recorder.hand_out("w", torch.empty(4, 3, dtype=torch.float32, device="meta"))
        real.copy_(w[2:])
        real[0] = w[0]
    assert real.eq(0).all()
    assert span_bytes(list(spans_of(recorder.regions()["w"]))) == set(range(0, 12)) | set(
        range(24, 48)
    )


def test_region_spans_coalesce_and_bound() -> None:
    # rows of a column slice: one strided span
    assert region_spans(Region(8, (4, 3), (24, 2), 2)) == [(8, 6, 24, 4)]
    # broadcast dims add nothing; an empty region is no span
    assert region_spans(Region(0, (5, 4), (0, 2), 2)) == [(0, 8, 8, 1)]
    assert region_spans(Region(0, (0, 4), (8, 2), 2)) == []
    # too many outer rows: the envelope
    spans = region_spans(Region(0, (70, 70, 2, 2), (80000, 1000, 40, 2), 2))
    assert spans == [(0, 69 * 80000 + 69 * 1000 + 40 + 2 + 2, 69 * 80000 + 69 * 1000 + 44, 1)]
