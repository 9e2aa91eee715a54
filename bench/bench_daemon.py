"""Daemon responsiveness: Status latency (idle and while warming at full speed) and how
long a Warm request of 100k / 1M spans takes to be accepted (first event received).

    .venv/bin/python bench/bench_daemon.py [--status-calls 300]

A real daemon on a private socket; files in a temporary directory, evicted before use.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import grpc
import numpy as np

from spanwarm.client import Client, TensorSpans
from spanwarm.client.client import message_dict
from spanwarm.pagecache.residency import evict
from spanwarm.rpc.v1 import warmer_pb2, warmer_pb2_grpc
from spanwarm.testing.spawn import spawn_daemon

MiB = 2**20


def percentiles(samples: list[float]) -> str:
    ms = sorted(s * 1000 for s in samples)
    p99 = ms[min(len(ms) - 1, int(len(ms) * 0.99))]
    return f"p50 {statistics.median(ms):.2f} ms, p99 {p99:.2f} ms, n={len(ms)}"


def status_latency(stub: warmer_pb2_grpc.WarmerStub, calls: int) -> list[float]:
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        stub.Status(warmer_pb2.StatusRequest(), timeout=10)
        samples.append(time.perf_counter() - start)
    return samples


def spans_request(path: Path, n: int, size: int) -> warmer_pb2.WarmRequest:
    """``n`` 4 KiB spans spread over the file, one tensor group per 100 spans."""
    offsets = np.linspace(0, size - 4096, n, dtype=np.int64) // 4096 * 4096
    return warmer_pb2.WarmRequest(
        job="bench",
        rank=0,
        files=[str(path)],
        groups=[f"t{i}" for i in range((n + 99) // 100)],
        file_index=np.zeros(n, dtype=np.int64).tolist(),
        offset=offsets.tolist(),
        length=[4096] * n,
        stride=[4096] * n,
        count=[1] * n,
        group_index=(np.arange(n) // 100).tolist(),
    )


def acceptance(stub: warmer_pb2_grpc.WarmerStub, request: warmer_pb2.WarmRequest) -> float:
    """Seconds from sending the request to receiving the accepted plan; then withdraw it."""
    start = time.perf_counter()
    call = stub.Warm(request, timeout=120)
    first = next(call)
    elapsed = time.perf_counter() - start
    assert first.HasField("plan")
    call.cancel()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--status-calls", type=int, default=300)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        big = Path(tmp) / "big.bin"
        with open(big, "wb") as f:
            block = np.random.default_rng(0).integers(0, 256, 64 * MiB, dtype=np.uint8).tobytes()
            for _ in range(16):
                f.write(block)
            os.fsync(f.fileno())
        evict(big)
        sparse = Path(tmp) / "sparse.bin"
        with open(sparse, "wb") as f:
            f.truncate(64 * 2**30)

        with (
            spawn_daemon("--log-level", "warning") as daemon,
            grpc.insecure_channel(
                f"unix:{daemon.socket}", options=[("grpc.max_send_message_length", 512 * MiB)]
            ) as channel,
        ):
            stub = warmer_pb2_grpc.WarmerStub(channel)
            print(f"Status, idle: {percentiles(status_latency(stub, args.status_calls))}")

            client = Client(daemon.socket)
            size = big.stat().st_size
            chunks = [
                TensorSpans(f"c{i}", str(big), offset, 8 * MiB, 8 * MiB, 1)
                for i, offset in enumerate(range(0, size, 8 * MiB))
            ]
            ticket = client.request(chunks, rank=0)
            busy: list[float] = []
            stop = threading.Event()

            def poll() -> None:
                while not stop.is_set():
                    busy.extend(status_latency(stub, 1))

            poller = threading.Thread(target=poll)
            start = time.perf_counter()
            poller.start()
            ticket.wait(timeout=120)
            warm_s = time.perf_counter() - start
            stop.set()
            poller.join()
            status = message_dict(stub.Status(warmer_pb2.StatusRequest(), timeout=10))
            print(
                f"Status, while warming 1 GiB ({warm_s:.2f} s, {size / warm_s / 2**30:.2f} GiB/s, "
                f"method {status['method']}): {percentiles(busy)}"
            )
            client.close()

            for n in (100_000, 1_000_000):
                request = spans_request(sparse, n, 64 * 2**30)
                times = [acceptance(stub, request) for _ in range(3)]
                print(
                    f"Warm acceptance, {n:,} spans in one request "
                    f"({request.ByteSize() / MiB:.1f} MiB on the wire): "
                    f"median {statistics.median(times) * 1000:.0f} ms "
                    f"(min {min(times) * 1000:.0f}, max {max(times) * 1000:.0f}, 3 runs)"
                )


if __name__ == "__main__":
    main()
