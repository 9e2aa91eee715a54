"""A request's spans on the wire: numbered by file and tensor, packed as columns."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from spanwarm.checkpoint.tensor_layout import TensorSpans
from spanwarm.client.wire import (
    COLUMNS,
    NumberedSpans,
    SpanColumns,
    drop_files,
    message_dict,
    span_bytes,
)
from spanwarm.rpc.v1 import warmer_pb2


def spans(tmp_path: Path) -> list[TensorSpans]:
    a, b = str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")
    relative_a = os.path.relpath(a)
    return [
        TensorSpans("x", a, 100, 10, 10, 1),
        TensorSpans("y", b, 0, 8, 32, 4),  # rows 32 apart: bytes 0..104
        TensorSpans("x", relative_a, 4000, 20, 20, 1),  # the same file, named otherwise
        TensorSpans("y", a, 50, 5, 5, 2),
    ]


def test_files_and_tensors_are_numbered_in_the_order_spans_first_name_them(
    tmp_path: Path,
) -> None:
    numbered = NumberedSpans.of(spans(tmp_path))
    assert numbered.files == [str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")]
    assert numbered.tensors == ["x", "y"]
    assert numbered.file_index == [0, 1, 0, 0]
    assert numbered.group_index == [0, 1, 0, 1]
    assert numbered.nbytes == [30, 42]  # x: 10 + 20; y: 4 x 8 + 2 x 5
    assert numbered.envelopes == {(0, 0): [100, 4020], (1, 1): [0, 104], (0, 1): [50, 60]}
    # Per file, for the in-line residency check: the envelopes' first bytes and ends.
    assert numbered.file_envelopes() == [([100, 50], [4020, 60]), ([0], [104])]


def test_columns_carry_every_span_into_a_request_and_back(tmp_path: Path) -> None:
    given = spans(tmp_path)
    columns = NumberedSpans.of(given).columns()
    request = columns.into(warmer_pb2.WarmRequest(groups=["x", "y"], job="j", rank=3))
    assert list(request.offset) == [s.offset for s in given]
    assert list(request.length) == [s.length for s in given]
    assert list(request.stride) == [s.stride for s in given]
    assert list(request.count) == [s.count for s in given]
    assert (request.job, request.rank) == ("j", 3)
    again = SpanColumns.of(warmer_pb2.WarmRequest.FromString(request.SerializeToString()))
    assert again.files == columns.files
    for name in COLUMNS:
        assert getattr(again, name).tolist() == getattr(columns, name).tolist()


def test_spans_left_out_keep_their_tensor_numbers_and_renumber_files(tmp_path: Path) -> None:
    columns = NumberedSpans.of(spans(tmp_path)).columns()
    assert columns.kept(np.ones(4, dtype=bool)) is columns
    assert columns.kept(np.zeros(4, dtype=bool)) is None
    only_b = columns.kept(np.array([False, True, False, False]))
    assert only_b is not None
    assert only_b.files == [str(tmp_path / "b.safetensors")]  # no file without a span
    assert only_b.file_index.tolist() == [0]
    assert only_b.group_index.tolist() == [1]  # the events still name y as 1
    assert only_b.offset.tolist() == [0]


def test_files_that_would_not_open_leave_with_their_tensors_named(tmp_path: Path) -> None:
    columns = NumberedSpans.of(spans(tmp_path)).columns()

    def request() -> Any:
        return columns.into(warmer_pb2.WarmRequest(groups=["x", "y"]))

    kept, dropped = drop_files(request(), {0: "a: cannot open it: Permission denied"})
    assert dropped == [([0, 1], "a: cannot open it: Permission denied")]
    assert list(kept.files) == [str(tmp_path / "b.safetensors")]
    assert list(kept.file_index) == [0]
    assert list(kept.group_index) == [1]
    given = request()
    whole, none = drop_files(given, {})
    assert whole is given
    assert none == []
    gone, both = drop_files(request(), {0: "a", 1: "b"})
    assert gone is None
    assert both == [([0, 1], "a"), ([1], "b")]


def test_span_bytes_are_each_spans_bytes_where_it_was_sent() -> None:
    request = warmer_pb2.WarmRequest(
        files=["/f"],
        file_index=[0, 0],
        offset=[0, 100],
        length=[10, 7],
        stride=[10, 64],
        count=[1, 3],
        group_index=[1, 0],
    )
    file_index, group_index, nbytes = span_bytes(request)
    assert file_index.tolist() == [0, 0]
    assert group_index.tolist() == [1, 0]
    assert nbytes.tolist() == [10.0, 21.0]


def test_a_message_becomes_plain_values() -> None:
    event = warmer_pb2.Plan(
        request_bytes=2**40,
        request_id=9,
        files=[warmer_pb2.FilePlan(path="/f", needed_bytes=5, stream_bytes_per_s=1.5e8)],
    )
    plain = message_dict(event)
    assert plain["request_bytes"] == 2**40  # a number, not MessageToDict's string
    assert plain["request_id"] == 9
    (file,) = plain["files"]
    assert file["path"] == "/f"
    assert file["needed_bytes"] == 5
    assert file["stream_bytes_per_s"] == pytest.approx(1.5e8)
    assert file["decision"] == ""  # unset fields too
