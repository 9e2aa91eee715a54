"""A learned seek cost per mount: the daemon probes a mount once no request is live,
plans with the figure, keeps it across restarts and shows it; --seek-cost overrides it.

Clients here ask for tensors resident or not (``read_yourself=False``): a load must reach
the daemon for it to have a mount to probe."""

from __future__ import annotations

import functools
import json
import os
import re
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from spanwarm.client import Client
from spanwarm.daemon import seek_probe
from spanwarm.daemon.files import FileIdentity, OpenFile
from spanwarm.daemon.seek_probe import SeekProber
from spanwarm.daemon.throughput import RANK_READ_BYTES, StreamThroughput, mount_name
from spanwarm.pagecache.residency import resident_bytes
from spanwarm.planning.costmodel import DEFAULT_SEEK_COST
from spanwarm.planning.seek_cost import MIN_FILE_BYTES
from tests.daemon_harness import cold_file, pinned, running_daemon
from tests.integration.test_daemon import MiB, span

FLAGS = ("--method", "read", "--log-level", "info")


def _probed(client: Client, timeout: float = 60.0) -> dict[str, Any]:
    """The one mount in Status once its seek cost is known."""
    deadline = time.monotonic() + timeout
    while True:
        mounts = client.status()["mounts"]
        if mounts and mounts[0]["seek_cost_bytes"]:
            (mount,) = mounts
            return dict(mount)
        assert time.monotonic() < deadline, mounts
        time.sleep(0.2)


def _load(client: Client, path: Path) -> None:
    ticket = client.request([span("head", path, 0, 4 * MiB)])
    assert ticket.wait(timeout=60)
    assert ticket.progress.ready == 1
    ticket.cancel()


def _seek_costs_logged(log: Path) -> list[int]:
    return [int(n) for n in re.findall(r"\(seek cost (\d+)\)", log.read_text())]


def test_an_idle_daemon_probes_the_mount_and_plans_with_it_after_a_restart(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    path = cold_file(tmp_path / "shard.safetensors", MIN_FILE_BYTES + 8 * MiB)
    size = os.stat(path).st_size
    first_log, second_log = tmp_path / "first.log", tmp_path / "second.log"
    with (
        first_log.open("wb") as stderr,
        running_daemon(*FLAGS, "--state-dir", str(state), stderr=stderr) as daemon,
    ):
        client = Client(daemon.socket, read_yourself=False)
        _load(client, path)
        mount = _probed(client)
        assert mount["mount"] == mount_name(os.stat(path).st_dev)
        assert 0 < mount["seek_cost_bytes"] < 64 * MiB  # a local disk, not a network mount
        learned, rate = mount["seek_cost_bytes"], mount["stream_bytes_per_s"]
        # What the probe read, nobody asked for: it left the page cache again.
        fd = os.open(path, os.O_RDONLY)
        try:
            assert resident_bytes(fd, 4 * MiB, size - 4 * MiB) == 0
        finally:
            os.close(fd)
        client.close()
        assert daemon.stop() == 0
    assert _seek_costs_logged(first_log) == [DEFAULT_SEEK_COST]  # the load came first
    assert f"seek cost of {mount['mount']}: {learned} bytes" in first_log.read_text()
    saved = json.loads((state / "devices.json").read_text())
    assert saved["mounts"][mount["mount"]]["seek_cost_bytes"] == learned
    # One lone stream's rate, as the probe measured it (over its long window), in a
    # rank's requests of a MiB, each paying a seek, bounds the ranks' waits: the daemon's
    # own per-stream figure, with its workers side by side, is lower on a disk.
    logged = re.findall(r"([0-9.]+) MiB/s over the long window", first_log.read_text())
    lone = float(logged[0]) * MiB
    assert saved["mounts"][mount["mount"]]["lone_bytes_per_s"] == pytest.approx(lone, rel=0.01)
    assert rate >= lone * RANK_READ_BYTES / (RANK_READ_BYTES + learned) * 0.99
    with (
        second_log.open("wb") as stderr,
        running_daemon(*FLAGS, "--state-dir", str(state), stderr=stderr) as daemon,
    ):
        client = Client(daemon.socket, read_yourself=False)
        kept = _probed(client, timeout=0)  # kept, not probed
        assert (kept["seek_cost_bytes"], kept["stream_bytes_per_s"]) == (learned, rate)
        _load(client, path)
        client.close()
    assert _seek_costs_logged(second_log) == [learned]
    assert "probed on" not in second_log.read_text()


def test_seek_cost_set_by_hand_is_used_and_nothing_is_probed(tmp_path: Path) -> None:
    path = cold_file(tmp_path / "shard.safetensors", MIN_FILE_BYTES + 8 * MiB)
    log = tmp_path / "daemon.log"
    with (
        log.open("wb") as stderr,
        running_daemon(*FLAGS, "--seek-cost", "1MiB", stderr=stderr) as daemon,
    ):
        client = Client(daemon.socket, read_yourself=False)
        _load(client, path)
        time.sleep(4)  # two idle ticks and then some: a probe would have started
        (mount,) = client.status()["mounts"]
        assert mount["seek_cost_bytes"] == 0
        assert client.status()["seek_cost_bytes"] == MiB
        client.close()
    assert _seek_costs_logged(log) == [MiB]
    assert "probed on" not in log.read_text()


def test_a_file_with_nothing_cold_is_passed_over_for_the_mounts_others(tmp_path: Path) -> None:
    warm = cold_file(tmp_path / "warm.safetensors", MIN_FILE_BYTES + 16 * MiB, seed=1)
    cold = cold_file(tmp_path / "cold.safetensors", MIN_FILE_BYTES + 8 * MiB, seed=2)
    log = tmp_path / "daemon.log"
    with (
        log.open("wb") as stderr,
        running_daemon(*FLAGS, stderr=stderr) as daemon,
    ):
        client = Client(daemon.socket, read_yourself=False)
        fd = os.open(warm, os.O_RDONLY)
        # All of it resident, and kept so (this VM reclaims idle page cache): nothing a
        # probe could measure.
        with pinned(fd, 0, os.fstat(fd).st_size):
            # One load names both: they are probed together, and only the cold one is read.
            ticket = client.request([span("w", warm, 0, 4 * MiB), span("c", cold, 0, 4 * MiB)])
            assert ticket.wait(timeout=60)
            ticket.cancel()
            assert _probed(client)["seek_cost_bytes"] > 0
        os.close(fd)
        client.close()
    assert f"probed on {cold}: " in log.read_text()


def test_a_checkpoint_of_small_files_is_probed_across_them(tmp_path: Path) -> None:
    # A DCP directory written by many ranks: no file holds the whole measurement.
    paths = [cold_file(tmp_path / f"__{i}_0.distcp", 20 * MiB, seed=i) for i in range(4)]
    log = tmp_path / "daemon.log"
    with log.open("wb") as stderr, running_daemon(*FLAGS, stderr=stderr) as daemon:
        client = Client(daemon.socket, read_yourself=False)
        ticket = client.request([span(f"t{i}", p, 0, MiB) for i, p in enumerate(paths)])
        assert ticket.wait(timeout=60)
        ticket.cancel()
        assert 0 < _probed(client)["seek_cost_bytes"] < 64 * MiB
        client.close()
    (line,) = [x for x in log.read_text().splitlines() if "probed on" in x]
    assert sum(str(p) in line for p in paths) >= 2
    for path in paths:  # what the probe read left the page cache again
        fd = os.open(path, os.O_RDONLY)
        try:
            assert resident_bytes(fd, MiB, 19 * MiB) == 0
        finally:
            os.close(fd)


def test_a_slow_mount_is_priced_at_its_latency_times_its_rate(tmp_path: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from spanwarm.testing.slowfs import fuse_available, mount

    if (reason := fuse_available()) is not None:
        pytest.skip(reason)
    source = tmp_path / "src"
    source.mkdir()
    cold_file(source / "shard.safetensors", MIN_FILE_BYTES + 8 * MiB)
    latency, bandwidth = 0.02, 64 * MiB  # a seek costs 0.02 s x 64 MiB/s = 1.28 MiB
    with (
        tempfile.TemporaryDirectory(prefix="sw-mnt-") as mnt,
        mount(source, Path(mnt), "local", latency_s=latency, stream_bytes_per_s=bandwidth),
        running_daemon(*FLAGS) as daemon,
    ):
        client = Client(daemon.socket, read_yourself=False)
        _load(client, Path(mnt) / "shard.safetensors")
        learned = _probed(client)["seek_cost_bytes"]
        client.close()
    expected = latency * bandwidth
    assert expected / 2 <= learned <= expected * 2, (learned, expected)


def _offered(path: Path) -> OpenFile:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    return OpenFile(str(path), fd, FileIdentity.of(os.fstat(fd)))


def _logged(caplog: pytest.LogCaptureFixture, text: str, times: int) -> bool:
    return caplog.text.count(text) == times


def _tick_until(prober: SeekProber, done: Callable[[], bool], timeout: float = 30.0) -> bool:
    """Tick as the node does while idle, faster, until ``done()`` (False at the timeout)."""
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            return False
        prober.tick(idle=True, busy=lambda: False)
        time.sleep(0.05)
    return True


def test_probes_stuck_in_hung_storage_are_given_up_and_their_user_gets_no_more(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from spanwarm.testing.slowfs import Hang, fuse_available, mount

    if (reason := fuse_available()) is not None:
        pytest.skip(reason)
    monkeypatch.setattr(seek_probe, "PROBE_TIMEOUT_S", 1.0)
    source = tmp_path / "src"
    source.mkdir()
    cold_file(source / "hung.bin", MIN_FILE_BYTES + 8 * MiB)
    local = cold_file(tmp_path / "local.bin", MIN_FILE_BYTES + 8 * MiB)
    learned = StreamThroughput()
    prober = SeekProber(learned, chunk=8 * MiB)
    opened: list[OpenFile] = []
    given_up = "has not returned"
    try:
        with (
            tempfile.TemporaryDirectory(prefix="sw-mnt-") as one,
            tempfile.TemporaryDirectory(prefix="sw-mnt-") as two,
            mount(source, Path(one), "local", hangs=[Hang("hung.bin", 3600)]),
            mount(source, Path(two), "local", hangs=[Hang("hung.bin", 3600)]),
        ):
            for n, mountpoint in enumerate((one, two), start=1):
                opened.append(_offered(Path(mountpoint) / "hung.bin"))
                prober.offer(opened[-1], uid=1000)
                assert _tick_until(prober, functools.partial(_logged, caplog, given_up, n))
            # Its mounts are not probed again, and that user's files no more at all.
            prober.offer(opened[0], uid=2000)
            opened.append(_offered(local))
            prober.offer(opened[-1], uid=1000)
            assert not _tick_until(prober, lambda: learned.seek_cost(os.stat(local).st_dev) > 0, 3)
            # Another user's request for the same local file: probed.
            prober.offer(opened[-1], uid=2000)
            assert _tick_until(prober, lambda: learned.seek_cost(os.stat(local).st_dev) > 0)
            assert caplog.text.count(given_up) == 2
    finally:
        prober.close()
        for file in opened:
            os.close(file.fd)


def test_a_failing_file_costs_neither_the_mount_its_figure_nor_others_their_probe(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from spanwarm.testing.slowfs import Fault, fuse_available, mount

    if (reason := fuse_available()) is not None:
        pytest.skip(reason)
    source = tmp_path / "src"
    source.mkdir()
    size = MIN_FILE_BYTES + 8 * MiB
    cold_file(source / "failing.bin", size)  # the largest: the windows go there first
    for i in range(4):
        cold_file(source / f"small{i}.bin", 20 * MiB, seed=i + 1)
    learned = StreamThroughput()
    prober = SeekProber(learned, chunk=8 * MiB)
    opened: list[OpenFile] = []
    before = _descriptors()
    try:
        with (
            tempfile.TemporaryDirectory(prefix="sw-mnt-") as mnt,
            mount(source, Path(mnt), "local", faults=[Fault("failing.bin", size // 2, size)]),
        ):
            for i, name in enumerate(["failing.bin", *(f"small{i}.bin" for i in range(4))]):
                opened.append(_offered(Path(mnt) / name))
                prober.offer(opened[-1], uid=1000 + i)
            device = opened[0].identity.device
            assert _tick_until(prober, lambda: learned.seek_cost(device) > 0)
            assert f"on {mnt}/failing.bin failed" in caplog.text
            assert caplog.text.count("failed") == 1
    finally:
        prober.close()
        for file in opened:
            os.close(file.fd)
    assert _descriptors() == before  # every copy the prober made is closed


def _descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_one_users_files_hold_at_most_their_share_of_the_waiting_room(tmp_path: Path) -> None:
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm: a second mount is needed")
    # Sparse files: offering looks at sizes only; nothing here is probed.
    opened = []
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        for i, directory in enumerate([tmp_path] * 6 + [Path(shm)] * 6):
            path = directory / f"f{i}.bin"
            with open(path, "wb") as f:
                f.truncate(MIN_FILE_BYTES + i * MiB)
            opened.append(_offered(path))
        prober = SeekProber(StreamThroughput(), chunk=8 * MiB)
        before = _descriptors()
        try:
            for file in opened:
                prober.offer(file, uid=1000)
            assert _descriptors() - before == 8  # the user's share, not the 12 it named
            # Another user's request still finds room.
            other = Path(shm) / "other.bin"
            with open(other, "wb") as f:
                f.truncate(MIN_FILE_BYTES)
            opened.append(_offered(other))
            before_other = _descriptors()
            prober.offer(opened[-1], uid=2000)
            assert _descriptors() - before_other == 1
        finally:
            prober.close()
            assert _descriptors() == before + 1  # every copy closed; "other" is ours
            for file in opened:
                os.close(file.fd)


def _disturbed_state(state: Path, mount: str, *, lone: float) -> None:
    """A state file as a disturbed probe left it: the daemon's own streams learned at
    20 MB/s over a GiB, and a lone stream of ``lone`` bytes/s, probed just now."""
    state.mkdir()
    figures = {
        "weighted_bytes": float(2**30),
        "weighted_seconds": 2**30 / 20e6,
        "total_bytes": 2**30,
        "seek_cost_bytes": 1,
        "seek_probed_at": time.time(),
        "lone_bytes_per_s": lone,
    }
    document = {"version": 1, "mounts": {mount: figures}}
    (state / "devices.json").write_text(json.dumps(document))


def test_a_kept_figure_a_disturbed_probe_left_is_probed_again_and_status_says_so(
    tmp_path: Path,
) -> None:
    # The lone stream below the daemon's own streams: something else read the disk while
    # that probe ran (88 MB/s against 800 on this machine's, and it stayed for a week).
    path = cold_file(tmp_path / "shard.safetensors", MIN_FILE_BYTES + 8 * MiB)
    name = mount_name(os.stat(path).st_dev)
    state = tmp_path / "state"
    _disturbed_state(state, name, lone=1e6)
    log = tmp_path / "daemon.log"
    with (
        log.open("wb") as stderr,
        running_daemon(*FLAGS, "--state-dir", str(state), stderr=stderr) as daemon,
    ):
        client = Client(daemon.socket, read_yourself=False)
        (kept,) = client.status()["mounts"]
        assert (kept["seek_cost_bytes"], kept.get("seek_probe_due")) == (1, True)
        _load(client, path)
        deadline = time.monotonic() + 60
        while (mount := client.status()["mounts"][0]).get("seek_probe_due"):
            assert time.monotonic() < deadline, mount
            time.sleep(0.2)
        client.close()
    saved = json.loads((state / "devices.json").read_text())["mounts"][name]
    assert saved["lone_bytes_per_s"] > 20e6  # a real lone stream, above the daemon's own
    assert f"seek cost of {name}: {mount['seek_cost_bytes']} bytes" in log.read_text()


def test_probes_slower_than_the_daemons_own_streams_are_retried_then_the_fastest_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(seek_probe, "DISTURBED_BACKOFF_S", 0.0)
    # Only the rate test here: the device's read counter is the next test's.
    monkeypatch.setattr(seek_probe, "device_read_bytes", lambda device: None)
    caplog.set_level("INFO", logger="spanwarm.daemon")
    path = cold_file(tmp_path / "shard.bin", MIN_FILE_BYTES + 8 * MiB)
    device = os.stat(path).st_dev
    name = mount_name(device)
    learned = StreamThroughput(str(tmp_path / "state"))
    learned.record(device, 2**30, 2**30 / 5e11)  # one stream at 500 GB/s: no probe is near
    prober = SeekProber(learned, chunk=8 * MiB)
    file = _offered(path)
    try:
        prober.offer(file, uid=1000)
        assert _tick_until(prober, lambda: learned.seek_cost(device) > 0)
        disturbed = re.findall(r"one lone stream ([0-9.]+) MiB/s, below", caplog.text)
        assert len(disturbed) == seek_probe.MAX_DISTURBED
        assert caplog.text.count("keeping the fastest") == 1
        saved = learned.snapshot()
        learned.save()
        kept = json.loads((tmp_path / "state" / "devices.json").read_text())["mounts"][name]
        fastest = max(float(x) for x in disturbed) * MiB
        assert kept["lone_bytes_per_s"] == pytest.approx(fastest, rel=0.01)
        # Bounded: the figure is still below the daemon's, but the mount is not probed
        # a fifth time this run, however often it is named.
        assert learned.probe_disturbed(name)
        assert not prober.due(name)
        prober.offer(file, uid=1000)
        assert not _tick_until(prober, lambda: learned.snapshot() != saved, 2)
        assert len(re.findall(r"one lone stream", caplog.text)) == seek_probe.MAX_DISTURBED
    finally:
        prober.close()
        os.close(file.fd)


def test_a_probe_while_something_else_reads_the_disk_is_not_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    path = cold_file(tmp_path / "shard.bin", MIN_FILE_BYTES + 8 * MiB)
    device = os.stat(path).st_dev
    if seek_probe.device_read_bytes(device) is None:
        pytest.skip(f"{tmp_path} is not on a block device with a read counter")
    monkeypatch.setattr(seek_probe, "DISTURBED_BACKOFF_S", 0.0)
    caplog.set_level("INFO", logger="spanwarm.daemon")
    other = cold_file(tmp_path / "other.bin", 64 * MiB, seed=3)
    stop = threading.Event()

    def read_the_disk() -> None:  # another job's load, without spanwarm
        fd = os.open(other, os.O_RDONLY)
        try:
            while not stop.is_set():
                for offset in range(0, 64 * MiB, MiB):
                    os.pread(fd, MiB, offset)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    reader = threading.Thread(target=read_the_disk, daemon=True)
    learned = StreamThroughput()
    prober = SeekProber(learned, chunk=8 * MiB)
    file = _offered(path)
    try:
        reader.start()
        prober.offer(file, uid=1000)
        assert _tick_until(prober, lambda: "disturbed (the device read" in caplog.text)
        assert learned.seek_cost(device) == 0  # not kept
        stop.set()
        reader.join()
        assert _tick_until(prober, lambda: learned.seek_cost(device) > 0)
        assert caplog.text.count("disturbed (") < seek_probe.MAX_DISTURBED
        assert "keeping the fastest" not in caplog.text
    finally:
        stop.set()
        prober.close()
        os.close(file.fd)


def test_what_another_process_reads_after_the_probe_stays_in_the_page_cache(
    tmp_path: Path,
) -> None:
    """The probe drops each window from the page cache as its read ends: a process that
    reads those bytes later (a job loading without spanwarm) keeps them, however long the
    rest of the probe takes."""
    from tests.daemon_harness import fuse_file

    size = MIN_FILE_BYTES + 8 * MiB
    # A slow stream: the probe's windows take a while, so the test reads between them.
    with fuse_file(tmp_path, "shard.bin", size, stream_bytes_per_s=64 * MiB) as (_, path):
        learned = StreamThroughput()
        prober = SeekProber(learned, chunk=MiB)
        file = _offered(path)
        try:
            prober.offer(file, uid=1000)
            deadline = time.monotonic() + 60
            running = None
            while running is None or len(running.read) < 2:  # the first window is read
                assert time.monotonic() < deadline, "the probe never read a second window"
                prober.tick(idle=True, busy=lambda: False)
                running = prober._running
                time.sleep(0.005)
            _, start, stop = running.read[0]
            fd = os.open(path, os.O_RDONLY)
            try:
                os.pread(fd, stop - start, start)  # another process's read of that window
                assert _tick_until(prober, lambda: prober._running is None, 60)
                assert resident_bytes(fd, start, stop - start) == stop - start
            finally:
                os.close(fd)
        finally:
            prober.close()
            os.close(file.fd)
