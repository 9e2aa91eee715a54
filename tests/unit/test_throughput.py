"""What the daemon learns of a mount from its own reads (daemon/throughput.py)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from spanwarm.daemon.throughput import StreamThroughput, mount_name

MOUNTINFO = """\
22 1 252:1 / / rw,relatime shared:1 - ext4 /dev/vda1 rw
40 22 0:52 / /mnt/ckpt rw,relatime shared:20 - nfs4 filer:/ckpt rw,vers=4.2
41 22 0:53 / /mnt/fast rw,relatime shared:21 - nfs4 filer:/ckpt rw,vers=4.2,nconnect=16
42 22 252:1 /data /srv/data rw - ext4 /dev/vda1 rw
"""


def test_mounts_are_named_by_type_source_and_mount_point(tmp_path: Path) -> None:
    info = tmp_path / "mountinfo"
    info.write_text(MOUNTINFO)
    assert mount_name(os.makedev(0, 52), str(info)) == "nfs4 filer:/ckpt /mnt/ckpt"
    assert mount_name(os.makedev(0, 53), str(info)) == "nfs4 filer:/ckpt /mnt/fast"
    assert mount_name(os.makedev(252, 1), str(info)) == "ext4 /dev/vda1 /"  # the first line
    assert mount_name(os.makedev(9, 9), str(info)) == "dev 9:9"
    assert mount_name(os.makedev(9, 9), str(tmp_path / "absent")) == "dev 9:9"


def test_throughput_needs_enough_cold_reads_and_weighs_recent_ones() -> None:
    learned = StreamThroughput()
    learned.record(1, 4 << 20, 0.04)  # 4 MiB: not enough to tell
    assert learned.bytes_per_s(1) == 0.0
    learned.record(1, 4 << 20, 0.04)
    assert learned.bytes_per_s(1) == pytest.approx((4 << 20) / 0.04)
    for _ in range(64):  # 4 GiB at a fifth of the speed: the old samples fade
        learned.record(1, 64 << 20, 3.2)
    assert learned.bytes_per_s(1) == pytest.approx((64 << 20) / 3.2, rel=0.02)
    learned.record(1, 1 << 20, 0.0)  # never a sample
    learned.record(1, 4096, 1.0)  # too small to say anything of a stream
    assert learned.bytes_per_s(1) == pytest.approx((64 << 20) / 3.2, rel=0.02)


@pytest.mark.parametrize(
    "content",
    [
        '{"version": 1, "mounts": {"m": {"weighted_bytes": 1' + "0" * 400 + ", "
        '"weighted_seconds": 1, "total_bytes": 1}}}',
        "[" * 100_000 + "]" * 100_000,
        '{"version": 1, "mounts": {"m": {"weighted_bytes": 1, "weighted_seconds": 1, '
        '"total_bytes": 1, "seek_cost_bytes": -5}}}',
        '{"version": 1, "mounts": {"m": {"weighted_bytes": 1, "weighted_seconds": 1, '
        '"total_bytes": 1, "seek_cost_bytes": 1.5}}}',
        '{"version": 1, "mounts": {"m": {"weighted_bytes": 1, "weighted_seconds": 1, '
        '"total_bytes": 1, "seek_cost_bytes": 1' + "0" * 30 + "}}}",
        '{"version": 1, "mounts": {"m": {"weighted_bytes": 1e300, "weighted_seconds": 1e-300, '
        '"total_bytes": 1000000000}}}',
        '{"version": 2, "mounts": {}}',
        "not json",
    ],
)
def test_a_damaged_state_file_starts_over(tmp_path: Path, content: str) -> None:
    (tmp_path / "devices.json").write_text(content)
    (tmp_path / "devices.json").chmod(0o600)
    learned = StreamThroughput(str(tmp_path))
    assert all(rate == 0.0 and not seek_cost for _, rate, _, seek_cost in learned.snapshot())


def test_what_was_learned_is_read_back(tmp_path: Path) -> None:
    first = StreamThroughput(str(tmp_path))
    for _ in range(4):
        first.record(os.makedev(0, 52), 4 << 20, 0.02)
    first.save()
    assert (tmp_path / "devices.json").stat().st_mode & 0o077 == 0
    again = StreamThroughput(str(tmp_path))
    assert again.snapshot() == first.snapshot()
    (tmp_path / "devices.json").chmod(0o666)  # writable by others: not trusted
    assert StreamThroughput(str(tmp_path)).snapshot() == []


def test_a_probed_seek_cost_is_kept_with_the_mount(tmp_path: Path) -> None:
    first = StreamThroughput(str(tmp_path))
    device = os.makedev(0, 52)
    assert first.seek_cost(device) == 0  # not measured
    first.learn_seek_cost(device, 0, math.inf)  # a measured zero still reads as known
    assert first.seek_cost(device) == 1
    assert first.bytes_per_s(device) == 0.0  # an infinite rate is not kept
    first.learn_seek_cost(device, 3 << 20, 700e6)
    first.save()
    again = StreamThroughput(str(tmp_path))
    assert again.seek_cost(device) == 3 << 20
    assert again.bytes_per_s(device) == pytest.approx(700e6 / 4)  # 1 MiB, and 3 MiB's time
    assert again.snapshot() == first.snapshot()
    # A state file from before the probe (no seek cost, no lone rate) still reads.
    document = json.loads((tmp_path / "devices.json").read_text())
    for entry in document["mounts"].values():
        del entry["seek_cost_bytes"], entry["lone_bytes_per_s"]
    (tmp_path / "devices.json").write_text(json.dumps(document))
    assert StreamThroughput(str(tmp_path)).seek_cost(device) == 0
    assert StreamThroughput(str(tmp_path)).bytes_per_s(device) == 0.0


def test_a_rank_waits_no_longer_than_a_lone_stream_reads(tmp_path: Path) -> None:
    """The daemon's per-stream figure under its own load is far below one lone reader on
    a fast disk; once the probe has measured the lone stream, what it gets in a rank's
    requests (each paying the mount's latency) is given where that is higher."""
    learned = StreamThroughput(str(tmp_path))
    device = os.makedev(0, 53)
    for _ in range(4):
        learned.record(device, 4 << 20, 0.05)  # 84 MB/s, 8 streams side by side
    under_load = learned.bytes_per_s(device)
    assert under_load == pytest.approx((4 << 20) / 0.05)
    learned.learn_seek_cost(device, 64 << 10, 700e6)  # a local disk: 0.1 ms per request
    assert learned.bytes_per_s(device) == pytest.approx(700e6 * 16 / 17)
    # A network mount that streams fast once going but pays 50 ms per request (the
    # emulated cross-region one: 143 MB/s, a 7.2 MB seek cost): one MiB at a time, a
    # rank's own reads get 18 MB/s, below the daemon's many in flight: learned stays.
    learned.learn_seek_cost(device, 7_200_000, 143e6)
    assert learned.bytes_per_s(device) == under_load
    learned.learn_seek_cost(device, 64 << 10, 700e6)
    learned.save()
    # --seek-cost: nothing is probed, and a lone rate kept from an earlier probe is not
    # used either; nor is one without the seek cost it was priced with (a damaged file).
    assert StreamThroughput(str(tmp_path), use_lone=False).bytes_per_s(device) == under_load
    document = json.loads((tmp_path / "devices.json").read_text())
    for entry in document["mounts"].values():
        entry["seek_cost_bytes"] = 0
    (tmp_path / "devices.json").write_text(json.dumps(document))
    assert StreamThroughput(str(tmp_path)).bytes_per_s(device) == pytest.approx(under_load)
    document = json.loads((tmp_path / "devices.json").read_text())
    # No storage streams 10 TB/s; nor a negative, NaN, true or textual rate: a damaged
    # file, not trusted in part.
    for damaged in (1e13, -1.0, math.nan, True, "700e6"):
        for entry in document["mounts"].values():
            entry["lone_bytes_per_s"] = damaged
        (tmp_path / "devices.json").write_text(json.dumps(document))
        assert StreamThroughput(str(tmp_path)).snapshot() == [], damaged


def test_a_symlink_in_place_of_the_state_directory_is_not_followed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Another user plants a symlink where the state directory goes: the daemon neither
    writes through it nor reads what it points to."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (tmp_path / "state").symlink_to(elsewhere)
    learned = StreamThroughput(str(tmp_path / "state"))
    for _ in range(4):
        learned.record(os.makedev(0, 52), 4 << 20, 0.02)
    learned.save()
    assert list(elsewhere.iterdir()) == []
    assert "cannot keep learned throughput" in caplog.text
    # One the daemon wrote itself, behind the symlink, is not read either.
    StreamThroughput(str(elsewhere)).save()
    first = StreamThroughput(str(elsewhere))
    first.record(os.makedev(0, 52), 4 << 20, 0.02)
    first.save()
    assert (elsewhere / "devices.json").exists()
    assert StreamThroughput(str(tmp_path / "state")).snapshot() == []


@pytest.mark.skipif(os.geteuid() != 0, reason="handing a directory to another user needs root")
def test_a_state_directory_another_user_owns_or_may_write_is_refused(tmp_path: Path) -> None:
    for owner, mode in ((65534, 0o700), (os.geteuid(), 0o777)):
        state = tmp_path / f"state-{owner}-{mode:o}"
        state.mkdir()
        os.chown(state, owner, -1)
        state.chmod(mode)
        learned = StreamThroughput(str(state))
        learned.record(os.makedev(0, 52), 4 << 20, 0.02)
        learned.save()
        assert list(state.iterdir()) == []
