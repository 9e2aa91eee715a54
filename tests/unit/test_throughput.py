"""What the daemon learns of a mount from its own reads (daemon/throughput.py)."""

from __future__ import annotations

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
