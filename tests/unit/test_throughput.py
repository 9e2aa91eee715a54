"""What the daemon learns of a mount from its own reads (daemon/throughput.py)."""

from __future__ import annotations

import pytest

from spanwarm.daemon.throughput import StreamThroughput


def test_learned_seek_cost_fits_latency_times_rate() -> None:
    """Reads that take latency + bytes/rate give the seek cost latency x rate; reads of one
    size (nothing to fit) give none."""
    learned = StreamThroughput()
    latency, rate = 0.004, 200e6  # 4 ms, 200 MB/s: 800 kB
    for i in range(200):
        nbytes = 4096 * (1 + i % 64)
        learned.record(1, nbytes, latency + nbytes / rate)
    assert learned.seek_cost(1) == pytest.approx(latency * rate, rel=0.01)
    same_size = StreamThroughput()
    for _ in range(200):
        same_size.record(2, 1 << 20, 0.01)
    assert same_size.seek_cost(2) is None
    few = StreamThroughput()
    for i in range(10):
        few.record(3, 4096 * (1 + i), latency + 4096 * (1 + i) / rate)
    assert few.seek_cost(3) is None


def test_throughput_needs_enough_cold_reads_and_weighs_recent_ones() -> None:
    learned = StreamThroughput()
    learned.record(1, 4 << 20, 0.04)  # 4 MiB: not enough to tell
    assert learned.bytes_per_s(1) == 0.0
    learned.record(1, 4 << 20, 0.04)
    assert learned.bytes_per_s(1) == pytest.approx((4 << 20) / 0.04)
    for _ in range(64):  # 4 GiB at half the speed: the old samples fade
        learned.record(1, 64 << 20, 1.28)
    assert learned.bytes_per_s(1) == pytest.approx((64 << 20) / 1.28, rel=0.02)
    learned.record(1, 1 << 20, float("nan"))  # never a sample
    learned.record(1, 0, 1.0)
    assert learned.bytes_per_s(1) == pytest.approx((64 << 20) / 1.28, rel=0.02)
