"""Tensors are ready as the pieces of their cell complete, not when the whole cell has.

A warm operation reads one cell (``--chunk-size``) in eight pieces; on slow storage the
last piece comes long after the first. A real daemon, throttled so that one 8 MiB cell
takes about two seconds, real files: a tensor at the front of a cell is ready (and
resident) while the cell's tail is still cold, and nothing is ready before every one of
its bytes is warm.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from spanwarm.client import Client, TensorSpans
from spanwarm.residency import resident_bytes
from tests.daemon_harness import cold_file, running_daemon

MiB = 2**20
KiB = 2**10
# One worker, 8 MiB cells (1 MiB pieces), 4 MiB/s: a piece every quarter second.
SLOW = ("--method", "read", "--throttle", "4MiB", "--chunk-size", "8MiB", "--workers", "1")


def resident(path: Path, offset: int, length: int) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        return resident_bytes(fd, offset, length)
    finally:
        os.close(fd)


def until(predicate: Callable[[], object], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.002)


def test_a_tensor_at_the_front_of_a_cell_is_ready_before_its_cell_is_read(
    tmp_path: Path,
) -> None:
    path = cold_file(tmp_path / "ckpt.safetensors", 8 * MiB)
    front = TensorSpans("front", str(path), 0, 64 * KiB, 64 * KiB, 1)
    tail = TensorSpans("tail", str(path), 7 * MiB, MiB, MiB, 1)
    with running_daemon(*SLOW) as daemon:  # 12 MiB seek cost: the cell is read whole
        client = Client(daemon.socket, read_yourself=False)
        start = time.monotonic()
        ticket = client.request([front, tail], rank=0)
        assert ticket.wait(["front"], timeout=30)
        first = time.monotonic() - start
        front_warm = resident(path, 0, 64 * KiB)  # right away: this VM reclaims idle cache
        tail_ready, tail_warm = ticket.ready("tail"), resident(path, 7 * MiB, MiB)
        assert ticket.wait(timeout=30)
        total = time.monotonic() - start
        client.close()
    assert front_warm == 64 * KiB
    assert not tail_ready
    assert tail_warm < MiB  # the cell was still being read
    assert ticket.progress.ready == 2
    assert first < total / 2, (first, total)


def test_a_tensor_is_ready_only_once_its_last_byte_in_the_cell_is_warm(tmp_path: Path) -> None:
    """A strided tensor whose rows reach far into the cell, and one spanning two cells,
    wait for all their bytes; each is checked resident the moment it is reported ready."""
    path = cold_file(tmp_path / "ckpt.safetensors", 16 * MiB)
    rows = TensorSpans("rows", str(path), 0, 64 * KiB, 2 * MiB, 4)  # last row at 6 MiB
    small = TensorSpans("small", str(path), 64 * KiB, 64 * KiB, 64 * KiB, 1)
    across = TensorSpans("across", str(path), 7 * MiB + 512 * KiB, MiB, MiB, 1)  # cells 0, 1
    spans = [small, rows, across]
    with running_daemon(*SLOW) as daemon:  # 12 MiB seek cost: the cell is read whole
        client = Client(daemon.socket, read_yourself=False)
        ticket = client.request(spans, rank=0)
        order: list[str] = []
        missing: dict[str, int] = {}
        last_row_warm = -1
        deadline = time.monotonic() + 60
        while len(order) < len(spans) and time.monotonic() < deadline:
            for s in spans:
                if s.tensor not in order and ticket.ready(s.tensor):
                    order.append(s.tensor)
                    missing[s.tensor] = sum(
                        s.length - resident(path, s.offset + i * s.stride, s.length)
                        for i in range(s.count)
                    )
                    if s.tensor == "small":
                        last_row_warm = resident(path, 6 * MiB, 64 * KiB)
            time.sleep(0.002)
        client.close()
    assert order == ["small", "rows", "across"], order
    assert missing == {"small": 0, "rows": 0, "across": 0}, missing
    assert last_row_warm < 64 * KiB  # small was ready while the cell was still being read


def test_ranks_sharing_a_cell_are_each_ready_at_their_own_bytes(tmp_path: Path) -> None:
    """Two ranks' tensors at either end of one cell: the front one's rank goes on while the
    other's bytes are still coming, and the cell is read once for both."""
    path = cold_file(tmp_path / "ckpt.safetensors", 8 * MiB)
    with running_daemon(*SLOW) as daemon:
        busy = cold_file(tmp_path / "busy", 2 * MiB, seed=1)
        a, b = (
            Client(daemon.socket, read_yourself=False),
            Client(daemon.socket, read_yourself=False),
        )
        # The one worker reads `busy` (half a second) while both requests are admitted, so
        # one operation serves both.
        hog = a.request([TensorSpans("busy", str(busy), 0, 2 * MiB, 2 * MiB, 1)], rank=2)
        until(lambda: hog.plan)
        rank0 = a.request([TensorSpans("front", str(path), 0, 256 * KiB, 256 * KiB, 1)], rank=0)
        rank1 = b.request([TensorSpans("tail", str(path), 7 * MiB, MiB, MiB, 1)], rank=1)
        until(lambda: rank0.plan and rank1.plan)
        both_queued = not hog.ready("busy")
        assert hog.wait(timeout=30)
        assert rank0.wait(timeout=30)
        tail_ready, tail_warm = rank1.ready("tail"), resident(path, 7 * MiB, MiB)
        assert rank1.wait(timeout=30)
        status = a.status()
        a.close()
        b.close()
    assert both_queued
    assert not tail_ready
    assert tail_warm < MiB
    assert status["bytes_read_total"] <= 10 * MiB * 1.05  # busy, then the cell once
