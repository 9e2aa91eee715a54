"""``_select_spans``: what a request keeps when a rank leaves spans out of it (tensors
already resident, files it could not open), checked against the spans themselves."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from spanwarm.client.wire import select_spans as _select_spans
from spanwarm.rpc.v1 import warmer_pb2


def _request(spans: list[tuple[int, int, int]], groups: int) -> warmer_pb2.WarmRequest:
    """One span per (file, offset, group): length 4096, one element. Files are listed as
    a client lists them: each once, in the order spans first name them."""
    files: dict[int, int] = {}
    for f, _, _ in spans:
        files.setdefault(f, len(files))
    return warmer_pb2.WarmRequest(
        files=[f"/ckpt/f{f}.safetensors" for f in files],
        groups=[f"t{g}" for g in range(groups)],
        file_index=[files[f] for f, _, _ in spans],
        offset=[o for _, o, _ in spans],
        length=[4096] * len(spans),
        stride=[4096] * len(spans),
        count=[1] * len(spans),
        group_index=[g for _, _, g in spans],
    )


def _named(request: warmer_pb2.WarmRequest) -> list[tuple[str, int, str]]:
    """Each span as what it means: (path, offset, tensor name)."""
    return [
        (request.files[f], o, request.groups[g])
        for f, o, g in zip(request.file_index, request.offset, request.group_index, strict=True)
    ]


spans_strategy = st.lists(
    st.tuples(st.integers(0, 4), st.integers(0, 100), st.integers(0, 7)), min_size=1, max_size=40
)


@settings(max_examples=200, deadline=None)
@given(spans=spans_strategy, first=st.data(), second=st.data())
def test_selected_spans_mean_the_same_bytes_and_files_stay_in_range(
    spans: list[tuple[int, int, int]], first: st.DataObject, second: st.DataObject
) -> None:
    spans = [(f, o * 4096, g) for f, o, g in spans]
    original = _named(_request(spans, 8))
    keep = np.array(first.draw(st.lists(st.booleans(), min_size=len(spans), max_size=len(spans))))
    request = _select_spans(_request(spans, 8), keep)
    expected = [s for s, k in zip(original, keep, strict=True) if k]
    if not expected:
        assert request is None
        return
    assert _named(request) == expected  # same paths, offsets and tensors, in order
    assert list(request.groups) == [f"t{g}" for g in range(8)]  # numbers kept for events
    assert sorted(set(request.file_index)) == list(range(len(request.files)))  # no spanless file
    # Then a second selection (a file the grant refused) of what is left.
    again = np.array(
        second.draw(st.lists(st.booleans(), min_size=len(expected), max_size=len(expected)))
    )
    request = _select_spans(request, again)
    expected = [s for s, k in zip(expected, again, strict=True) if k]
    if not expected:
        assert request is None
    else:
        assert _named(request) == expected
        assert sorted(set(request.file_index)) == list(range(len(request.files)))


def test_keeping_everything_is_the_same_request() -> None:
    request = _request([(0, 0, 0), (1, 4096, 1)], 2)
    assert _select_spans(request, np.array([True, True])) is request
