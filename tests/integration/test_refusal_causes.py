"""Refusals the operator can see: counted by cause in ``spanwarm status`` and the metrics,
and a checkpoint the jobs see at another path than the daemon named in the daemon's log.

The daemon here sees the checkpoint under its allowed root ``daemon-view``, the job under
``job-view``: the same files (hard links, which is what a bind mount at another path
looks like to the allowed-roots check: the job's descriptor is named by the job's path,
and the daemon finds the same inode under its root). deploy/container's test runs the
same mistake with the daemon in a container (tests/container/).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from spanwarm.client import Client, TensorSpans
from tests.daemon_harness import cold_file, running_daemon
from tests.integration.test_observability import free_port, scrape

MiB = 2**20


def _views(tmp_path: Path) -> tuple[Path, Path]:
    """(the job's path, the daemon's) for one checkpoint file."""
    job, daemon = tmp_path / "job-view" / "model", tmp_path / "daemon-view" / "model"
    job.mkdir(parents=True)
    daemon.mkdir(parents=True)
    path = cold_file(job / "model-00001.safetensors", 4 * MiB)
    os.link(path, daemon / path.name)
    return path, daemon / path.name


def test_refusals_are_counted_by_cause_and_a_mount_at_another_path_is_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    job_path, daemon_path = _views(tmp_path)
    allowed = tmp_path / "daemon-view"
    port = free_port()
    log = tmp_path / "daemon.log"
    with (
        open(log, "wb") as stderr,
        running_daemon(
            "--allow", str(allowed), "--metrics", f"127.0.0.1:{port}", stderr=stderr
        ) as daemon,
    ):
        client = Client(daemon.socket, read_yourself=False)
        try:
            for _ in range(3):  # three loads, one warning
                ticket = client.request([TensorSpans("t", str(job_path), 0, MiB, MiB, 1)])
                assert ticket.wait(timeout=30)
                assert ticket.progress.ready == 0
            # Where the daemon sees it, it warms; a span past the end is a Warm refused.
            good = client.request([TensorSpans("t", str(daemon_path), 0, MiB, MiB, 1)])
            assert good.wait(timeout=30)
            past = client.request([TensorSpans("t", str(daemon_path), 4 * MiB, MiB, MiB, 1)])
            assert past.wait(timeout=30)
            status = client.status()
            metrics = scrape(port)
        finally:
            client.close()
        shown = subprocess.run(
            [sys.executable, "-m", "spanwarm", "status", "--socket", daemon.socket],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    # Until now, only the ranks' logs said so.
    ranks = [r.getMessage() for r in caplog.records if r.name == "spanwarm.client"]
    assert sum("outside the allowed roots" in m for m in ranks) == 3, ranks
    assert good.progress.ready == 1, good.failures
    assert past.progress.ready == 0
    assert sum("OUT_OF_RANGE" in m for m in ranks) == 1, ranks
    assert status["refusals"] == [
        {"cause": "outside_allowed_roots", "count": 3},
        {"cause": "out_of_range", "count": 1},
    ]
    assert "refused: outside_allowed_roots 3, out_of_range 1" in shown
    assert metrics['spanwarm_refusals_total{cause="outside_allowed_roots"}'] == 3
    assert metrics['spanwarm_refusals_total{cause="out_of_range"}'] == 1
    warnings = [line for line in log.read_text().splitlines() if "WARNING" in line]
    assert len(warnings) == 1, warnings
    (warning,) = warnings
    # The path the job used, where the daemon sees the file, and the mount to change.
    assert repr(str(job_path)) in warning
    assert repr(str(daemon_path)) in warning
    assert f"The job has the checkpoint at {str(tmp_path / 'job-view')!r}" in warning
    assert f"and the daemon at {str(allowed)!r}" in warning


def test_a_file_the_daemon_cannot_find_under_its_roots_is_logged_with_the_path_to_mount(
    tmp_path: Path,
) -> None:
    (tmp_path / "elsewhere").mkdir()
    path = cold_file(tmp_path / "elsewhere" / "f", MiB)
    (tmp_path / "allowed").mkdir()
    log = tmp_path / "daemon.log"
    with (
        open(log, "wb") as stderr,
        running_daemon("--allow", str(tmp_path / "allowed"), stderr=stderr) as daemon,
    ):
        client = Client(daemon.socket, read_yourself=False)
        try:
            ticket = client.request([TensorSpans("t", str(path), 0, MiB, MiB, 1)])
            assert ticket.wait(timeout=30)
            status = client.status()
        finally:
            client.close()
    assert status["refusals"] == [{"cause": "outside_allowed_roots", "count": 1}]
    (warning,) = [line for line in log.read_text().splitlines() if "WARNING" in line]
    assert "sees no such file under them" in warning
    assert f"(here {str(tmp_path / 'elsewhere')!r})" in warning
