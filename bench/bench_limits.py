"""What one hostile or very large request costs the daemon: answer time, peak and after RSS.

    .venv/bin/python bench/bench_limits.py [--markdown PATH]

A real daemon (default flags) on a private socket; a sparse 4 TiB file (no disk used).
Each request is sent alone; the daemon's VmRSS is sampled every 10 ms from the call until
the request has ended (cancelled after its plan) and 2 s more. The first rows are the
amplification the robustness issue found (refused by the work limits before anything is
built); the others sit just inside the default limits.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import numpy as np

from spanwarm.rpc.v1 import warmer_pb2, warmer_pb2_grpc
from spanwarm.testing.spawn import spawn_daemon

MiB = 2**20
CELL = 8 * MiB


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS"):
            return int(line.split()[1]) * 1024
    return 0


def cases() -> dict[str, dict[str, list[int]]]:
    def strided(n: int, count: int, stride: int) -> dict[str, list[int]]:
        return {
            "offset": [i * 4096 for i in range(n)],
            "length": [4096] * n,
            "stride": [stride] * n,
            "count": [count] * n,
        }

    def plain(offsets: np.ndarray, length: int) -> dict[str, list[int]]:
        n = len(offsets)
        return {
            "offset": offsets.tolist(),
            "length": [length] * n,
            "stride": [length] * n,
            "count": [1] * n,
        }

    return {
        "128 strided spans, 4 KiB every 16 MiB x 65,536 (the issue's case)": strided(
            128, 65_536, 16 * MiB
        ),
        "1,024 such spans": strided(1024, 65_536, 16 * MiB),
        "130,000 cells, one 4 KiB span each (max_cells is 131,072)": plain(
            np.arange(130_000) * CELL, 4096
        ),
        "8 strided spans over 125,000 cells (2M span-cells is the limit)": strided(
            8, 125_000, CELL
        ),
        "1,000,000 spans of 512 B in 128 cells": plain(
            (np.arange(1_000_000) % 2048) * 4096 * 128 % (128 * CELL), 512
        ),
    }


def measure(
    stub: warmer_pb2_grpc.WarmerStub, pid: int, path: str, cols: dict[str, list[int]]
) -> str:
    n = len(cols["offset"])
    request = warmer_pb2.WarmRequest(
        job="limits",
        rank=0,
        files=[path],
        groups=["g"],
        file_index=[0] * n,
        group_index=[0] * n,
        offset=cols["offset"],
        length=cols["length"],
        stride=cols["stride"],
        count=cols["count"],
    )
    peak = [0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], rss(pid))
            time.sleep(0.01)

    sampler = threading.Thread(target=sample)
    sampler.start()
    start = time.monotonic()
    call = stub.Warm(request, timeout=300)
    try:
        outcome = "heartbeat"
        events = iter(call)
        while outcome == "heartbeat":
            outcome = next(events).WhichOneof("event") or "?"
        outcome = "accepted"
    except grpc.RpcError as exc:
        outcome = f"{exc.code().name}"
    took = time.monotonic() - start
    call.cancel()
    time.sleep(2.0)
    stop.set()
    sampler.join()
    return f"| {outcome} | {took:.2f} s | {peak[0] / MiB:.0f} MiB | {rss(pid) / MiB:.0f} MiB |"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    lines = [
        "```console\npython bench/bench_limits.py\n```\n",
        "One request at a time against one daemon (default flags), over a sparse 4 TiB file. "
        "RSS sampled every 10 ms; *after* is 2 s after the request ended.\n",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "sparse")
        with open(path, "wb") as f:
            f.truncate(4 * 2**40)
        with (
            spawn_daemon("--log-level", "warning") as daemon,
            grpc.insecure_channel(
                f"unix:{daemon.socket}", options=[("grpc.max_send_message_length", 2**27)]
            ) as channel,
        ):
            stub = warmer_pb2_grpc.WarmerStub(channel)
            stub.Status(warmer_pb2.StatusRequest(), timeout=10)
            baseline = rss(daemon.process.pid)
            lines.append(f"Daemon RSS at start: {baseline / MiB:.0f} MiB.\n")
            lines += [
                "| request | answer | time to answer | peak RSS | RSS after |",
                "| --- | --- | --- | --- | --- |",
            ]
            for label, cols in cases().items():
                row = measure(stub, daemon.process.pid, path, cols)
                lines.append(f"| {label} {row}")
                print(lines[-1], file=sys.stderr, flush=True)
    text = "\n".join(lines) + "\n"
    if args.markdown:
        args.markdown.write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
