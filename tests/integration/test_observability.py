"""Metrics and logs, scraped and parsed from a real daemon."""

from __future__ import annotations

import json
import os
import socket
import urllib.request
from pathlib import Path

from spanwarm.client import Client, TensorSpans
from spanwarm.pagecache.residency import resident_bytes
from tests.daemon_harness import cold_file, running_daemon

MiB = 2**20


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def test_metrics_show_the_bytes_residency_shows(tmp_path: Path) -> None:
    path = cold_file(tmp_path / "f", 24 * MiB)
    port = free_port()
    spans = [TensorSpans(f"t{i}", str(path), i * 4 * MiB, 2 * MiB, 2 * MiB, 1) for i in range(6)]
    with running_daemon(
        "--metrics", f"127.0.0.1:{port}", "--method", "read", "--seek-cost", "0"
    ) as daemon:
        client = Client(daemon.socket, read_yourself=False)
        ticket = client.request(spans, rank=0)
        assert ticket.wait(timeout=30)
        fd = os.open(path, os.O_RDONLY)
        resident = sum(resident_bytes(fd, i * 4 * MiB, 2 * MiB) for i in range(6))
        os.close(fd)
        metrics = scrape(port)
        client.close()
    warmed = (
        metrics['spanwarm_warmed_bytes_total{method="read"}']
        + metrics["spanwarm_found_resident_bytes_total"]
    )
    assert resident >= 12 * MiB * 0.995
    assert warmed == 12 * MiB
    assert metrics["spanwarm_requested_bytes_total"] == 12 * MiB
    assert metrics["spanwarm_warm_operation_seconds_count"] == 3  # two spans per 8 MiB cell


def test_json_logs_carry_one_decision_line_per_request(tmp_path: Path) -> None:
    path = cold_file(tmp_path / "f", 8 * MiB)
    log = tmp_path / "daemon.log"
    with open(log, "wb") as stderr, running_daemon("--log-format", "json", stderr=stderr) as daemon:
        client = Client(daemon.socket, read_yourself=False)
        assert client.request([TensorSpans("t", str(path), 0, MiB, MiB, 1)], job="j1", rank=3).wait(
            timeout=30
        )
        client.close()
    records = [json.loads(line) for line in log.read_text().splitlines()]
    decisions = [r for r in records if r.get("job") == "j1"]
    assert len(decisions) == 1
    (decision,) = decisions
    assert decision["level"] == "info"
    assert decision["rank"] == 3
    (file,) = decision["files"]
    assert file["path"] == str(path)
    assert file["decision"] in ("spans", "whole")
    assert {"cost_bytes", "whole_cost_bytes", "num_runs", "warm_bytes"} <= set(file)
