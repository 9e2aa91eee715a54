"""The daemon stays responsive while many ranks are admitted, and its command line works.

Responsiveness is checked as a bound a frozen loop would break (every Status answered
within 1 s, the issue's probe budget), not as a speed target: the figures are in
docs/BENCHMARKS.md (bench/bench_load.py).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from spanwarm.cli import build_parser
from spanwarm.rpc.v1 import warmer_pb2, warmer_pb2_grpc
from tests.daemon_harness import running_daemon

MiB = 2**20


def _rank_request(path: Path, size: int, rank: int, spans: int) -> warmer_pb2.WarmRequest:
    rng = np.random.default_rng(rank)
    offsets = np.sort(rng.integers(0, size // 4096 - 16, spans)) * 4096
    return warmer_pb2.WarmRequest(
        job="load",
        rank=rank,
        files=[str(path)],
        groups=[f"t{i}" for i in range(spans // 10)],
        file_index=[0] * spans,
        offset=offsets.tolist(),
        length=[16384] * spans,
        stride=[16384] * spans,
        count=[1] * spans,
        group_index=(np.arange(spans) // 10).tolist(),
    )


def test_status_answers_within_a_second_while_ranks_are_admitted(tmp_path: Path) -> None:
    path = tmp_path / "sparse.safetensors"
    size = 64 * 2**30  # sparse: planning and indexing cost the same, reads cost nothing
    with open(path, "wb") as f:
        f.truncate(size)
    ranks, spans = 32, 10_000
    requests = [_rank_request(path, size, rank, spans) for rank in range(ranks)]
    latencies: list[float] = []
    planned: list[int] = []
    with (
        running_daemon("--method", "read", "--seek-cost", "0") as daemon,
        grpc.insecure_channel(f"unix:{daemon.socket}") as channel,
    ):
        stub = warmer_pb2_grpc.WarmerStub(channel)
        calls = [stub.Warm(request, timeout=120) for request in requests]

        def first_event(call: grpc.Call) -> None:
            for event in call:
                if event.HasField("plan"):
                    planned.append(event.plan.request_id)
                    return

        readers = [threading.Thread(target=first_event, args=(c,)) for c in calls]
        for reader in readers:
            reader.start()
        while any(r.is_alive() for r in readers):
            start = time.monotonic()
            stub.Status(warmer_pb2.StatusRequest(), timeout=5)
            latencies.append(time.monotonic() - start)
            time.sleep(0.01)
        for call in calls:
            call.cancel()
    assert len(planned) == ranks
    assert latencies
    assert max(latencies) < 1.0, (len(latencies), sorted(latencies)[-5:])


def _subcommands() -> list[str]:
    parser = build_parser()
    actions = [a for a in parser._actions if a.dest == "command"]
    return sorted(actions[0].choices)  # type: ignore[arg-type]


@pytest.mark.parametrize("command", ["", *_subcommands()])
def test_every_help_works(command: str) -> None:
    args = [command, "--help"] if command else ["--help"]
    result = subprocess.run(
        [sys.executable, "-m", "spanwarm", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "usage: spanwarm" in result.stdout
    assert not result.stderr


def test_version() -> None:
    from spanwarm import __version__

    result = subprocess.run(
        [sys.executable, "-m", "spanwarm", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert result.stdout.strip() == f"spanwarm {__version__}"
