"""A rank's own cold reads are hinted byte for byte (real files in tmp_path).

A fault on a missing page of a mapping reads the device's read-ahead window around it;
a ``WILLNEED`` for exactly a tensor's bytes first makes the fault wait for those pages
instead. Checked on this VM's disk (``read_ahead_kb`` 8192) with mincore.
"""

from __future__ import annotations

import json
import mmap
import os
import time
from pathlib import Path

import numpy as np
import pytest

from spanwarm.client.client import Ticket
from spanwarm.client.own_reads import OwnReads
from spanwarm.client.tensor_state import TensorState
from spanwarm.pagecache.residency import PAGE, resident_bytes
from spanwarm.rpc.v1 import warmer_pb2
from tests.daemon_harness import cold_file, fuse_file

MiB = 2**20


def request(files: list[str], spans: list[tuple[int, int, int, int, int, int]]) -> object:
    """A WarmRequest of (file, offset, length, stride, count, group) spans."""
    columns = list(zip(*spans, strict=True)) if spans else [()] * 6
    return warmer_pb2.WarmRequest(
        files=files,
        file_index=columns[0],
        offset=columns[1],
        length=columns[2],
        stride=columns[3],
        count=columns[4],
        group_index=columns[5],
    )


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def settled_residency(fd: int, offset: int, length: int, want: int) -> int:
    """Resident bytes of the range once the kernel's reads in flight have landed."""
    deadline = time.monotonic() + 10
    got = resident_bytes(fd, offset, length)
    while got < want and time.monotonic() < deadline:
        time.sleep(0.01)
        got = resident_bytes(fd, offset, length)
    return got


def test_each_group_gets_its_own_spans_rows_or_envelope() -> None:
    reads = OwnReads(
        request(
            ["a", "b"],
            [
                (1, 500, 100, 100, 1, 2),  # one span
                (0, 0, 10, 10, 4, 0),  # contiguous rows: one range
                (0, 100_000, 10, 10_000, 3, 0),  # strided, few rows pages apart: row by row
                (1, 0, 8, 16, 1000, 1),  # strided, many rows: its envelope
                (0, 7, 0, 0, 1, 2),  # empty: nothing
                (0, 0, 1024, PAGE, 100, 3),  # rows a page apart: every page, so the envelope
                (0, 10 * PAGE, 100, 3 * PAGE // 2, 4, 4),  # rows in touching pages: joined
                (0, 15 * PAGE + 8, 100, 100, 1, 4),  # a span in the next page: joined
            ],
        )
    )
    rows = [(0, 100_000, 100_010), (0, 110_000, 110_010), (0, 120_000, 120_010)]
    assert reads.ranges(0) == [(0, 0, 40), *rows]
    assert reads.ranges(1) == [(1, 0, 999 * 16 + 8)]  # the envelope: twice its bytes
    assert reads.ranges(2) == [(1, 500, 600)]
    assert reads.ranges(3) == [(0, 0, 99 * PAGE + 1024)]
    # Rows 1.5 pages apart: pages 10, 11, 13, 14 hold them; 12 is not read, so not hinted.
    assert reads.ranges(4) == [
        (0, 10 * PAGE, 11 * PAGE + PAGE // 2 + 100),
        (0, 13 * PAGE, 15 * PAGE + 108),
    ]
    assert reads.ranges(5) == reads.ranges(-1) == []  # not in the request


def test_a_hint_never_reads_much_more_than_the_tensor_nor_too_much_at_once() -> None:
    rows = [(0, 0, 4096, 64 * MiB, 100, 0), (0, 0, 4096, 64 * MiB, 2000, 1)]  # sparse rows
    big = [(0, 0, 100 * MiB, 100 * MiB, 1, 2), (0, 200 * MiB, MiB, MiB, 1, 2)]
    reads = OwnReads(request(["a"], [*rows, *big]))
    # Rows 64 MiB apart: row by row, not the 6.3 GiB envelope; too many rows: no hint.
    assert reads.ranges(0) == [(0, r * 64 * MiB, r * 64 * MiB + 4096) for r in range(100)]
    assert reads.ranges(1) == []
    # A large tensor: only its first 32 MiB (its reads' own read-ahead covers the rest).
    assert reads.ranges(2) == [(0, 0, 32 * MiB)]


def test_a_hinted_read_through_a_mapping_reads_the_tensor_not_a_window(tmp_path: Path) -> None:
    path = cold_file(tmp_path / "ckpt.safetensors", 64 * MiB)
    fd = os.open(path, os.O_RDONLY)
    try:
        with mmap.mmap(fd, 0, prot=mmap.PROT_READ) as mapping:
            # Unhinted, a fault reads around itself (on a device with read-ahead).
            _ = mapping[8 * MiB : 8 * MiB + MiB]  # a copy: every page faulted in
            around = settled_residency(fd, 0, 32 * MiB, MiB)
            if around <= MiB + 64 * 2**10:
                pytest.skip(f"no read-around on this device ({around} bytes for 1 MiB)")
            reads = OwnReads(request([str(path)], [(0, 40 * MiB, MiB, MiB, 1, 0)]))
            reads.hint(0)
            _ = mapping[40 * MiB : 41 * MiB]
            assert settled_residency(fd, 40 * MiB, MiB, MiB) == MiB
            # Only the tensor: nothing of the window a fault would have read around it.
            assert resident_bytes(fd, 32 * MiB, 32 * MiB) == MiB
            reads.close()
    finally:
        os.close(fd)
    assert around > 2 * MiB  # what the hint saved


def test_descriptors_open_on_the_first_hint_and_close_with_the_request(tmp_path: Path) -> None:
    paths = [cold_file(tmp_path / f"{i}.safetensors", 4 * MiB, seed=i) for i in range(3)]
    spans = [(i, 0, PAGE, PAGE, 1, i) for i in range(3)] + [(0, PAGE, PAGE, PAGE, 1, 3)]
    reads = OwnReads(request([*map(str, paths), str(tmp_path / "missing")], spans))
    before = open_fds()
    assert reads.open_descriptors == 0  # nothing opened for a load that reads nothing cold
    reads.hint(0)
    reads.hint(3)  # the same file: its descriptor again
    assert (reads.open_descriptors, open_fds()) == (1, before + 1)
    reads.hint(1)
    assert open_fds() == before + 2
    reads.close()
    assert open_fds() == before
    reads.hint(2)  # after the request ended: no hint, nothing opened
    assert open_fds() == before
    fd = os.open(paths[2], os.O_RDONLY)
    try:
        assert resident_bytes(fd, 0, PAGE) == 0
    finally:
        os.close(fd)


def test_a_file_that_will_not_open_is_not_hinted(tmp_path: Path) -> None:
    reads = OwnReads(request([str(tmp_path / "gone")], [(0, 0, PAGE, PAGE, 1, 0)]))
    reads.hint(0)  # no error: the loader's own open says what is wrong
    assert reads.open_descriptors == 0
    reads.close()


def test_a_ticket_hints_what_it_tells_the_loader_to_read_cold(tmp_path: Path) -> None:
    path = cold_file(tmp_path / "ckpt.safetensors", 32 * MiB)
    ticket = Ticket(["cold", "warm"], [4 * MiB, 4 * MiB])
    ticket._own_reads = OwnReads(
        request([str(path)], [(0, 8 * MiB, 4 * MiB, 4 * MiB, 1, 0), (0, 0, MiB, MiB, 1, 1)])
    )
    ticket._read_yourself_s = np.array([0.001, 0.001])  # sooner read than waited for
    ticket._mark([1], TensorState.READY)  # "warm": ready, read from the page cache, no hint
    assert ticket.wait_for_read("cold") == "read"
    assert ticket.wait_for_read("warm") == "ready"
    fd = os.open(path, os.O_RDONLY)
    try:
        assert settled_residency(fd, 8 * MiB, 4 * MiB, 4 * MiB) == 4 * MiB
        assert resident_bytes(fd, 0, 8 * MiB) == 0  # the ready one was not hinted
        assert resident_bytes(fd, 12 * MiB, 20 * MiB) == 0
    finally:
        os.close(fd)
    before = open_fds()
    # Nothing pending: nothing more to hint, its descriptor goes.
    ticket._mark([0], TensorState.READY)
    assert open_fds() == before - 1
    assert ticket._own_reads is None


def test_a_hint_says_how_much_of_the_tensor_was_not_in_the_page_cache(tmp_path: Path) -> None:
    """The share of a tensor's pages not cached as its read begins: what the rank's own
    read brings from storage (Ticket.took counts only that), not what the daemon brought
    already without reporting the tensor warm yet."""
    path = cold_file(tmp_path / "ckpt.safetensors", 16 * MiB)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.preadv(fd, [bytearray(3 * MiB)], 4 * MiB)  # 3 MiB of the tensor's 4 already read
        tensors = [(0, 4 * MiB, 4 * MiB, 4 * MiB, 1, 0), (0, 12 * MiB, MiB, MiB, 1, 1)]
        reads = OwnReads(request([str(path)], tensors))
        share = reads.hint(0)
        if share is None:
            pytest.skip("cachestat(2) refused here")
        assert share == pytest.approx(0.25, abs=0.01)
        assert reads.hint(1) == 1.0  # cold throughout
        assert reads.hint(1) == 0.0  # hinted just now: in the page cache, or being read
        reads.close()
        assert reads.hint(0) is None  # the request ended: nothing hinted, nothing known
    finally:
        os.close(fd)


def test_a_long_tensor_on_a_small_window_is_read_in_order(tmp_path: Path) -> None:
    """On FUSE (128 KiB windows) each hinted window is a request of the rank's descriptor
    in flight: 64 of them for an 8 MiB tensor, served in any order, each out-of-order one
    a seek to a network file system. A tensor of more than a few windows is hinted by
    its first; the loader's reads stream the rest through the kernel's read-ahead.

    Seeks are counted per descriptor, from the mount's trace: the hint's descriptor sends
    one request; the loader's stream is in order but for where its copy touches first.
    A large ``memcpy`` (glibc's vector copy; not ``rep movsb``) loads the last bytes of
    the range before the first, so the loader's first fault can be at its end: one more
    seek on the loader's own descriptor that no hint can cause or prevent."""
    trace = tmp_path / "trace.jsonl"
    # A slow stream (8 MiB in 0.25 s), so that requests sent at once are in flight at once.
    with fuse_file(
        tmp_path, "ckpt.safetensors", 16 * MiB, stream_bytes_per_s=32 * MiB, trace=trace
    ) as (fs, path):
        window = fs.read_ahead_kb * 2**10
        assert 8 * MiB // window > 16  # else this mount shows nothing
        reads = OwnReads(request([str(path)], [(0, 4 * MiB, 8 * MiB, 8 * MiB, 1, 0)]))
        fd = os.open(path, os.O_RDONLY)
        try:
            with mmap.mmap(fd, 0, prot=mmap.PROT_READ) as mapping:
                reads.hint(0)
                _ = mapping[4 * MiB : 12 * MiB]  # the loader's read: every page faulted in
        finally:
            os.close(fd)
            reads.close()
        stats = fs.stats()
    counts = stats["files"]["ckpt.safetensors"]
    assert 8 * MiB <= counts["bytes"] <= 8 * MiB + 2 * window
    assert stats["max_in_flight"] <= 4
    per_handle: dict[int, list[tuple[int, int]]] = {}
    for line in trace.read_text().splitlines():
        served = json.loads(line)
        per_handle.setdefault(served["handle"], []).append((served["offset"], served["size"]))
    hint_handle = next(iter(per_handle))  # the hint is sent before the loader reads
    assert per_handle[hint_handle] == [(4 * MiB, window)]  # one window, one request
    (loader,) = (reqs for handle, reqs in per_handle.items() if handle != hint_handle)
    assert _seeks(loader) <= 2  # its first request, and its copy's tail touched first


def _seeks(requests: list[tuple[int, int]]) -> int:
    """Requests of one descriptor that do not continue its stream (as the mount counts)."""
    from spanwarm.testing.slowfs import STREAM_TOLERANCE

    seeks, end = 0, None
    for offset, size in requests:
        seeks += end is None or abs(offset - end) > STREAM_TOLERANCE
        end = offset + size
    return seeks


def test_a_slice_of_short_rows_is_hinted_in_whole_windows(tmp_path: Path) -> None:
    """A tensor split by columns is rows shorter than a page, each in a page of its own.
    Hinted row by row, each page was a request of its own (162 round trips for one TP
    slice of the end-to-end benchmark on FUSE); its pages are a few windows."""
    rows = 256
    with fuse_file(tmp_path, "ckpt.safetensors", 4 * MiB) as (fs, path):
        window = fs.read_ahead_kb * 2**10
        reads = OwnReads(request([str(path)], [(0, MiB + 512, 1024, PAGE, rows, 0)]))
        before = fs.stats()["requests"]
        share = reads.hint(0)
        reads.close()
        fd = os.open(path, os.O_RDONLY)
        try:
            # Every page of the slice arrives: the hint's, not the loader's reads.
            assert settled_residency(fd, MiB, rows * PAGE, rows * PAGE) == rows * PAGE
        finally:
            os.close(fd)
        stats = fs.stats()
    assert share == 1.0
    assert stats["requests"] - before <= -(-rows * PAGE // window) + 1
    assert stats["files"]["ckpt.safetensors"]["bytes"] == rows * PAGE
