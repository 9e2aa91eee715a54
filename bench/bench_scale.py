"""Scale: node plan time and daemon memory for 1, 8 and 64 local ranks and 10^4 .. 10^6
spans in all, with the requests live at once.

    .venv/bin/python bench/bench_scale.py [--quick]

Each rank sends one Warm request for its share of the spans (4 KiB spans spread over a
64 GiB sparse file, the ranks' spans interleaved). Measured: how long the last request
takes to be accepted (it re-plans the union of every rank's spans: the node plan), the
same plan computed in-process (``plan_file`` over the union), and the daemon's RSS with
every request live. Warming is throttled so the requests stay live while measured.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import numpy as np

from spanwarm.checkpoint.spans import SpanTable
from spanwarm.client import Client
from spanwarm.planning.costmodel import DEFAULT_SEEK_COST, plan_file
from spanwarm.rpc.v1 import warmer_pb2, warmer_pb2_grpc
from spanwarm.testing.spawn import spawn_daemon

SIZE = 64 * 2**30
SPAN = 4096


def rank_offsets(total: int, ranks: int, rank: int) -> np.ndarray:
    """Rank ``rank``'s share of ``total`` evenly spread 4 KiB spans (interleaved)."""
    every = np.linspace(0, SIZE - SPAN, total, dtype=np.int64) // SPAN * SPAN
    return every[rank::ranks]


def request(path: Path, offsets: np.ndarray, rank: int) -> warmer_pb2.WarmRequest:
    n = len(offsets)
    return warmer_pb2.WarmRequest(
        job="scale",
        rank=rank,
        files=[str(path)],
        groups=[f"t{i}" for i in range((n + 99) // 100)],
        file_index=[0] * n,
        offset=offsets.tolist(),
        length=[SPAN] * n,
        stride=[SPAN] * n,
        count=[1] * n,
        group_index=(np.arange(n) // 100).tolist(),
    )


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def in_process_plan_s(total: int, ranks: int) -> float:
    tables = []
    for rank in range(ranks):
        offsets = rank_offsets(total, ranks, rank)
        n = len(offsets)
        tables.append(SpanTable(offsets, np.full(n, SPAN), np.full(n, SPAN), np.ones(n, np.int64)))
    start = time.perf_counter()
    plan_file("f", SIZE, SpanTable.concat(tables), DEFAULT_SEEK_COST)
    return time.perf_counter() - start


def measure(path: Path, total: int, ranks: int) -> tuple[float, int, int]:
    """(acceptance of the last request, daemon RSS with all live, RSS idle)."""
    with spawn_daemon(
        "--log-level", "warning", "--throttle", "64MiB", "--drain-seconds", "0"
    ) as daemon:
        idle = rss_bytes(daemon.process.pid)
        with grpc.insecure_channel(
            f"unix:{daemon.socket}", options=[("grpc.max_send_message_length", 2**29)]
        ) as channel:
            stub = warmer_pb2_grpc.WarmerStub(channel)
            calls = []
            accepted: list[float] = []
            lock = threading.Lock()

            def send(rank: int) -> None:
                message = request(path, rank_offsets(total, ranks, rank), rank)
                start = time.perf_counter()
                call = stub.Warm(message, timeout=600)
                next(call)  # the plan: the request is registered and the node re-planned
                with lock:
                    accepted.append(time.perf_counter() - start)
                    calls.append(call)

            # The ranks arrive one after another; the last one re-plans everything.
            for rank in range(ranks - 1):
                send(rank)
            last_start = time.perf_counter()
            send(ranks - 1)
            last = time.perf_counter() - last_start
            client = Client(daemon.socket)
            assert len(client.status()["ranks"]) == ranks
            live = rss_bytes(daemon.process.pid)
            client.close()
            for call in calls:
                call.cancel()
    return last, live, idle


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="10^4 and 10^5 spans only")
    args = parser.parse_args()
    totals = (10_000, 100_000) if args.quick else (10_000, 100_000, 1_000_000)
    print(f"```console\npython bench/bench_scale.py {' '.join(sys.argv[1:])}\n```\n")
    print(
        "| local ranks | spans in all | node plan in-process (median of 3) "
        "| last request accepted | daemon RSS, all live (idle) |"
    )
    print("| --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "sparse.bin"
        with open(path, "wb") as f:
            f.truncate(SIZE)
        for ranks in (1, 8, 64):
            for total in totals:
                plan_s = statistics.median(in_process_plan_s(total, ranks) for _ in range(3))
                last, live, idle = measure(path, total, ranks)
                print(
                    f"| {ranks} | {total:,} | {plan_s * 1000:.0f} ms | {last * 1000:.0f} ms | "
                    f"{live / 2**20:.0f} MiB ({idle / 2**20:.0f} MiB) |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
