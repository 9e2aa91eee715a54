"""spanwarm residency and spanwarm calibrate, on real files and on the emulated mount."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from spanwarm.cli.calibrate import write_seek_cost
from spanwarm.planning.calibrate import calibrate
from tests.daemon_harness import cold_file, pinned

MiB = 2**20


def spanwarm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "spanwarm", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_residency_reports_resident_bytes(tmp_path: Path) -> None:
    path = cold_file(tmp_path / "f", 8 * MiB)
    fd = os.open(path, os.O_RDONLY)
    try:
        # Read in by locking it, and kept: this VM's reclaim would take pages meanwhile.
        with pinned(fd, 2 * MiB, MiB):
            result = spanwarm(
                "residency", "--json", str(path), f"{path}:2MiB:1MiB", str(tmp_path / "gone")
            )
            table = spanwarm("residency", f"{path}:2MiB:1MiB")
    finally:
        os.close(fd)
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert result.returncode == 1  # the missing file
    assert "gone: No such file" in result.stderr
    whole, part = lines
    assert whole["length"] == 8 * MiB
    assert MiB <= whole["resident_bytes"] < 8 * MiB
    assert part["resident_bytes"] == MiB
    assert part["trusted"] is True
    assert "1.0 MiB of 1.0 MiB resident (100.0%)" in table.stdout


def test_write_seek_cost_keeps_the_rest(tmp_path: Path) -> None:
    toml = tmp_path / "spanwarm.toml"
    toml.write_text('workers = 4\nseek_cost = "12MiB"\n')
    write_seek_cost(toml, 123456)
    assert toml.read_text().splitlines()[0] == "workers = 4"
    assert toml.read_text().splitlines()[1].startswith("seek_cost = 123456")
    fresh = tmp_path / "new.toml"
    write_seek_cost(fresh, 7)
    assert fresh.read_text().startswith("seek_cost = 7")


def test_calibrate_recovers_the_emulated_mounts_seek_cost(tmp_path: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from spanwarm.testing.slowfs import fuse_available, mount

    if (reason := fuse_available()) is not None:
        pytest.skip(reason)
    source = tmp_path / "src"
    source.mkdir()
    cold_file(source / "big", 128 * MiB)
    latency, bandwidth = 0.01, 96 * MiB  # a seek costs 0.01 s x 96 MiB/s = 0.96 MiB
    with (
        tempfile.TemporaryDirectory(prefix="sw-mnt-") as mnt,
        mount(source, Path(mnt), "local", latency_s=latency, stream_bytes_per_s=bandwidth),
    ):
        # The mount charges latency for a jump of more than 2 MiB: spans >= 512 KiB at 12.5%
        # leave gaps of 3.5 MiB and more, so each one is a seek there.
        result = calibrate(str(Path(mnt) / "big"), sizes=(512 << 10, MiB, 2 * MiB, 4 * MiB))
    expected = latency * bandwidth
    assert expected / 2 <= result.seek_cost <= expected * 2, (result.seek_cost, expected)
    assert result.breakeven is not None
