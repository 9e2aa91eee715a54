"""The first page a safetensors slice faults in is asked for with the slice."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from spanwarm.checkpoint.resolve import open_checkpoint
from spanwarm.checkpoint.tensor_layout import TensorSpans, stored_tensor_spans
from spanwarm.client.first_pages import first_page_span, tensor_first_pages, with_first_pages
from spanwarm.pagecache.residency import PAGE, evict, resident_pages

MiB = 2**20


def test_a_span_past_the_first_page_gets_that_page_before_it() -> None:
    begin = 3 * PAGE + 100  # a tensor starting mid-page, 1 MiB long
    rows = TensorSpans("w", "/f", begin + 512 * 2**10, 1024, 4096, 4)
    assert first_page_span("w", "/f", begin, begin + MiB, rows.offset) == TensorSpans(
        "w", "/f", begin, PAGE - 100, PAGE - 100, 1
    )
    # The span starts in the first page already: its page is warmed with it.
    assert first_page_span("w", "/f", begin, begin + MiB, 4 * PAGE - 1) is None
    # A tensor ending within its first page: only its bytes.
    assert first_page_span("w", "/f", begin, begin + 50, begin + 40) is None
    assert first_page_span("w", "/f", begin, begin + 50, 10 * PAGE) == TensorSpans(
        "w", "/f", begin, 50, 50, 1
    )
    # No span of it at all (an empty slice): its page; a tensor of no bytes: nothing.
    assert first_page_span("w", "/f", begin, begin + MiB, None) == TensorSpans(
        "w", "/f", begin, PAGE - 100, PAGE - 100, 1
    )
    assert first_page_span("w", "/f", begin, begin, None) is None


def _checkpoint(tmp_path: Path) -> Path:
    from safetensors.numpy import save_file

    path = tmp_path / "model.safetensors"
    save_file(
        {
            # 12 MiB: w starts past what reading the header brings in (8 MiB here)
            "a": np.ones((3 * 2**20,), dtype=np.float32),
            "w": np.arange(4096 * 1024, dtype=np.float32).reshape(4096, 1024),  # 16 MiB
        },
        str(path),
    )
    return path


def test_each_tensor_and_file_gets_one_touch_before_its_first_span(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path)
    ckpt = open_checkpoint(path)
    ((header, w),) = ckpt.pieces["w"]
    begin = header.file_offset(w)
    second_half = stored_tensor_spans("w", ckpt.pieces["w"], (((2048, 4096),), ((0, 1024),)))
    columns = stored_tensor_spans("w", ckpt.pieces["w"], (((1024, 2048),), ((512, 1024),)))
    whole_a = stored_tensor_spans("a", ckpt.pieces["a"], None)
    spans = [*whole_a, *columns, *second_half]
    out = with_first_pages(spans, ckpt)
    touch = TensorSpans("w", str(path), begin, PAGE - begin % PAGE, PAGE - begin % PAGE, 1)
    # "a" is read from its first byte; "w" gets one page, before its first span.
    assert out == [*whole_a, touch, *columns, *second_half]
    # Reading from the tensor's first row: nothing added.
    first_rows = stored_tensor_spans("w", ckpt.pieces["w"], (((0, 8),), ((0, 1024),)))
    assert with_first_pages([*first_rows, *second_half], ckpt) == [*first_rows, *second_half]


def test_a_slice_read_after_its_request_is_warm_reads_nothing_more(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from safetensors import safe_open

    path = _checkpoint(tmp_path)
    ckpt = open_checkpoint(path)
    spans = with_first_pages(
        stored_tensor_spans("w", ckpt.pieces["w"], (((2048, 2056),), ((0, 1024),))), ckpt
    )
    ((header, w),) = ckpt.pieces["w"]
    first = header.file_offset(w) // PAGE  # w's pages, past what the header read brings
    evict(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # exactly the spans' pages
        for s in spans:
            for i in range(s.count):
                os.pread(fd, s.length, s.offset + i * s.stride)
        warmed = resident_pages(fd, 0, os.fstat(fd).st_size)[first:].copy()
        with safe_open(str(path), "pt") as f:
            rows = f.get_slice("w")[2048:2056].clone()
        after = resident_pages(fd, 0, os.fstat(fd).st_size)[first:]
    finally:
        os.close(fd)
    assert torch.equal(rows.flatten(), torch.arange(2048 * 1024, 2056 * 1024, dtype=torch.float32))
    # The slice faulted in no page of w that was not warmed: its rows and its first page
    # were (without that page: the mount's read-around of it, 2048 pages on this disk).
    assert warmed.sum() == 1 + 8 + 1  # the first page; 32 KiB of rows, not page-aligned
    assert np.array_equal(after, warmed)


def test_an_empty_slice_faults_in_the_first_page_and_nothing_more(tmp_path: Path) -> None:
    """A rank whose box of a tensor is empty still slices it (transformers does, for a
    dimension smaller than its mesh): the slice reads the tensor's first byte."""
    pytest.importorskip("torch")
    from safetensors import safe_open

    path = _checkpoint(tmp_path)
    ckpt = open_checkpoint(path)
    ((header, w),) = ckpt.pieces["w"]
    (touch,) = tensor_first_pages("w", ckpt.pieces["w"], [])
    assert (touch.offset, touch.length) == (
        header.file_offset(w),
        PAGE - header.file_offset(w) % PAGE,
    )
    assert tensor_first_pages("w", [*ckpt.pieces["w"], *ckpt.pieces["a"]], []) == []  # in pieces
    first = header.file_offset(w) // PAGE

    def faulted(spans: list[TensorSpans]) -> int:
        """Pages of w an empty slice faults in beyond ``spans`` read beforehand."""
        evict(path)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            for s in spans:
                os.pread(fd, s.length, s.offset)
            warmed = resident_pages(fd, 0, os.fstat(fd).st_size)[first:].copy()
            with safe_open(str(path), "pt") as f:
                assert tuple(f.get_slice("w")[4096:4096].shape) == (0, 1024)
            after = resident_pages(fd, 0, os.fstat(fd).st_size)[first:]
        finally:
            os.close(fd)
        return int((after & ~warmed).sum())

    assert faulted([touch]) == 0
    assert faulted([]) > 0  # without the page: the slice reads it cold, with read-around
