"""No harm on fast storage: a rank does not queue behind a daemon it would outread.

The daemon learns what one stream of cold reads gets on each device from its own reads
(the storage's time, not its throttle) and sends it with the plan; a rank waits for a
tensor at most as long as reading it itself would take (``Ticket.wait_for_read``).
A throttled daemon on local disk is the case where that matters: it is far slower than
the disk it learned.
"""

from __future__ import annotations

import json
import mmap
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from spanwarm.client import Client
from spanwarm.client.access import grant
from spanwarm.daemon.throughput import mount_name
from spanwarm.pagecache.residency import resident_bytes
from tests.daemon_harness import cold_file, running_daemon
from tests.integration.test_daemon import MiB, resident, span

FLAGS = ("--method", "read", "--workers", "1", "--chunk-size", "4MiB", "--seek-cost", "0")


def test_a_rank_reads_itself_what_the_daemon_would_bring_later(tmp_path: Path) -> None:
    first = cold_file(tmp_path / "first.safetensors", 16 * MiB, seed=1)
    second = cold_file(tmp_path / "second.safetensors", 32 * MiB, seed=2)
    with running_daemon(*FLAGS, "--throttle", "4MiB") as daemon:
        client = Client(daemon.socket)
        learning = client.request([span("w", first, 0, 16 * MiB)])
        assert learning.wait(timeout=60)
        assert [f["stream_bytes_per_s"] for f in learning.plan] == [0.0]  # nothing known yet
        tensors = [span("a", second, 0, 16 * MiB), span("b", second, 16 * MiB, 16 * MiB)]
        ticket = client.request(tensors)  # waited on at once: before its plan arrives
        outcome = ticket.wait_for_read("a", timeout=60)
        warm_when_answered = ticket.ready("a")
        (plan,) = ticket.plan
        # The daemon learned the disk (its I/O time, not the 4 MiB/s throttle): reading
        # 16 MiB here takes a fraction of the 4 s the throttled daemon needs.
        assert plan["stream_bytes_per_s"] > 32 * MiB
        assert outcome == "read"
        assert not warm_when_answered  # never reported ready early: it simply was not
        # Nothing is marked ready that is not warm: "a" becomes ready only once warmed.
        assert ticket.wait(["a"], timeout=60)
        assert ticket.progress.ready >= 1
        ticket.cancel()
        client.close()


def test_until_a_device_is_known_ranks_wait(tmp_path: Path) -> None:
    path = cold_file(tmp_path / "only.safetensors", 8 * MiB)
    with running_daemon(*FLAGS, "--throttle", "16MiB") as daemon:
        client = Client(daemon.socket)
        ticket = client.request([span("a", path, 0, 8 * MiB)])
        assert ticket.wait_for_read("a", timeout=60) == "ready"
        assert ticket.progress.ready == 1
        client.close()


def test_what_a_daemon_learned_survives_a_restart(tmp_path: Path) -> None:
    state = tmp_path / "state"
    first = cold_file(tmp_path / "first.safetensors", 16 * MiB, seed=3)
    second = cold_file(tmp_path / "second.safetensors", 8 * MiB, seed=4)
    with running_daemon(*FLAGS, "--state-dir", str(state)) as daemon:
        client = Client(daemon.socket)
        assert client.request([span("w", first, 0, 16 * MiB)]).wait(timeout=60)
        client.close()
        assert daemon.stop() == 0  # SIGTERM: what it learned is written on the way out
    saved = json.loads((state / "devices.json").read_text())
    (mount,) = saved["mounts"]
    assert mount == mount_name(os.stat(first).st_dev)
    assert (state / "devices.json").stat().st_mode & 0o077 == 0
    with running_daemon(*FLAGS, "--state-dir", str(state)) as daemon:
        client = Client(daemon.socket)
        ticket = client.request([span("a", second, 0, 8 * MiB)])
        assert ticket.wait(timeout=60)
        (plan,) = ticket.plan
        assert plan["stream_bytes_per_s"] > 0  # known from the first load on
        (shown,) = client.status()["mounts"]
        assert shown["mount"] == mount
        assert shown["sampled_bytes"] >= 16 * MiB
        client.close()


def test_a_state_file_that_does_not_parse_is_ignored(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / "devices.json").write_text('{"version": 1, "mounts": {"x": {"weighted_bytes": -1')
    path = cold_file(tmp_path / "only.safetensors", 4 * MiB)
    log = tmp_path / "daemon.log"
    with (
        log.open("wb") as stderr,
        running_daemon(*FLAGS, "--state-dir", str(state), stderr=stderr) as daemon,
    ):
        client = Client(daemon.socket)
        ticket = client.request([span("a", path, 0, 4 * MiB)])
        assert ticket.wait(timeout=60)
        assert [f["stream_bytes_per_s"] for f in ticket.plan] == [0.0]
        client.close()
    assert "devices.json (learned throughput starts over)" in log.read_text()


def test_a_tensor_already_in_the_page_cache_is_read_at_once(tmp_path: Path) -> None:
    """The daemon's one worker is busy for seconds with another load; a tensor already
    resident is not worth waiting for, and is not reported ready by the daemon either."""
    busy = cold_file(tmp_path / "busy.safetensors", 32 * MiB, seed=5)
    warm = cold_file(tmp_path / "warm.safetensors", 8 * MiB, seed=6)
    warm.read_bytes()  # now resident
    with running_daemon(*FLAGS, "--throttle", "1MiB") as daemon:
        other, client = Client(daemon.socket), Client(daemon.socket)
        slow = other.request([span("x", busy, 0, 32 * MiB)], rank=0)
        while not slow.plan:  # its first 4 MiB read (4 s at 1 MiB/s) holds the worker
            time.sleep(0.01)
        # One more tensor, cold, so that the request does go to the daemon.
        tensors = [span("w", warm, 0, 4 * MiB), span("c", busy, 0, 4 * MiB)]
        ticket = client.request(tensors, rank=1)
        outcome = ticket.wait_for_read("w", timeout=60)
        assert outcome == "read"
        # Counted as resident, not as warmed: the daemon was not asked for it.
        assert (ticket.progress.resident, ticket.progress.ready) == (1, 0)
        slow.cancel()
        ticket.cancel()
        other.close()
        client.close()


def test_a_rank_with_everything_resident_reads_at_once_and_asks_for_nothing(
    tmp_path: Path,
) -> None:
    """Nothing to wait for and nothing the daemon could add: no grant, no request, no
    work for the daemon on the cores the load needs; the tensors count as resident, not
    as warmed by the daemon."""
    path = cold_file(tmp_path / "warm.safetensors", 8 * MiB, seed=7)
    path.read_bytes()
    with running_daemon(*FLAGS, "--throttle", "1MiB") as daemon:
        client = Client(daemon.socket)
        ticket = client.request([span("a", path, 0, 4 * MiB), span("b", path, 4 * MiB, 4 * MiB)])
        assert [ticket.wait_for_read(name, timeout=60) for name in ("a", "b")] == ["read"] * 2
        assert ticket.wait(timeout=60)
        assert ticket.finished.wait(timeout=60)
        progress = ticket.progress
        assert (progress.resident, progress.ready, progress.failed) == (2, 0, 0)
        assert progress.done
        assert not ticket.failures
        assert ticket.plan == []
        status = client.status()
        assert status["ranks"] == []  # it never asked
        assert status["files"] == []
        assert status["bytes_read_total"] == status["bytes_verified_total"] == 0
        ticket.cancel()
        client.close()


def test_a_request_resident_but_for_a_few_pages_is_not_sent(tmp_path: Path) -> None:
    """Twelve of the request's 13 MiB resident, one MiB cold, on a disk the daemon knows at
    1 GB/s: reading that MiB here takes about a millisecond, less than asking would cost
    the node, so after the grant nothing goes out; the rank reads it itself. Known at
    10 MB/s (0.1 s for that MiB), the same request is sent and the daemon warms it."""
    for rate, sent in ((1e9, False), (1e7, True)):
        path = cold_file(tmp_path / f"ckpt-{sent}.safetensors", 16 * MiB, seed=8)
        with path.open("rb", buffering=0) as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)  # no read-ahead
            f.read(12 * MiB)
        tensors = [span("warm", path, 0, 12 * MiB), span("cold", path, 14 * MiB, MiB)]
        state = learned_state(tmp_path / f"state-{sent}", path, rate)
        with running_daemon(*FLAGS, "--state-dir", str(state)) as daemon:
            client = Client(daemon.socket)
            ticket = client.request(tensors)
            if not sent:
                assert [ticket.wait_for_read(n, timeout=60) for n in ("warm", "cold")] == [
                    "read",
                    "read",
                ]
                assert ticket.finished.wait(timeout=60)
                progress = ticket.progress
                assert (progress.resident, progress.own, progress.ready) == (1, 1, 0)
                assert progress.done
                assert ticket.plan == []
                status = client.status()
                assert status["ranks"] == []
                assert status["bytes_read_total"] == 0
                assert resident(path, 14 * MiB, MiB) == 0  # nothing read it for the rank
            else:
                assert ticket.wait(timeout=60)
                progress = ticket.progress
                assert (progress.resident, progress.own, progress.ready) == (1, 0, 1)
                assert resident(path, 14 * MiB, MiB) == MiB
            ticket.cancel()
            client.close()


def test_a_partly_resident_request_reads_only_the_resident_tensors_at_once(
    tmp_path: Path,
) -> None:
    """One tensor resident, one cold: the first is read at once and not asked for; the
    second waits for the daemon, which has learned nothing of this disk yet (so waiting
    is the safe choice)."""
    path = cold_file(tmp_path / "half.safetensors", 8 * MiB, seed=8)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead into "b"
        assert len(os.pread(fd, 4 * MiB, 0)) == 4 * MiB
    finally:
        os.close(fd)
    assert resident(path, 4 * MiB, 4 * MiB) == 0
    with running_daemon(*FLAGS, "--throttle", "16MiB") as daemon:
        client = Client(daemon.socket)
        ticket = client.request([span("a", path, 0, 4 * MiB), span("b", path, 4 * MiB, 4 * MiB)])
        assert ticket.wait_for_read("a", timeout=60) == "read"
        assert ticket.wait_for_read("b", timeout=60) == "ready"
        assert ticket.ready("b")
        # Ready means warm (but for a few pages this VM's reclaim of idle cache may take).
        assert resident(path, 4 * MiB, 4 * MiB) >= 4 * MiB - 64 * 1024
        # Only the cold tensor was asked for: the daemon planned none of "a"'s bytes.
        assert ticket.plan[0]["needed_bytes"] == 4 * MiB
        assert (ticket.progress.resident, ticket.progress.ready) == (1, 1)
        ticket.cancel()
        client.close()


@pytest.mark.parametrize("cold_at", [0, 1, 3])
def test_only_the_cold_file_of_a_resident_request_is_asked_for(
    tmp_path: Path, cold_at: int
) -> None:
    """Three resident files and a cold one, first, between them or last in request order:
    the in-line check stops at the cold file and the full check goes on from there with
    what it found (``resident_files``, then ``ResidencyCheck(settled=...)``). The three
    are read at once, the cold tensor alone is asked for and warmed."""
    files = [cold_file(tmp_path / f"r{i}.safetensors", 4 * MiB, seed=40 + i) for i in range(3)]
    for path in files:
        path.read_bytes()
    cold = cold_file(tmp_path / "cold.safetensors", 4 * MiB, seed=50)
    tensors = [span(f"t{i}", path, 0, 4 * MiB) for i, path in enumerate(files)]
    tensors.insert(cold_at, span("c", cold, 0, 4 * MiB))
    with running_daemon(*FLAGS) as daemon:
        client = Client(daemon.socket)
        ticket = client.request(tensors)
        assert [ticket.wait_for_read(f"t{i}", timeout=60) for i in range(3)] == ["read"] * 3
        assert ticket.wait(timeout=60)
        progress = ticket.progress
        assert (progress.resident, progress.ready) == (3, 1)
        assert [(f["path"], f["needed_bytes"]) for f in ticket.plan] == [(str(cold), 4 * MiB)]
        assert resident(cold, 0, 4 * MiB) == 4 * MiB
        ticket.cancel()
        client.close()


def test_a_small_cold_tensor_is_not_taken_for_resident(tmp_path: Path) -> None:
    """A few KiB missing from a large tensor is slack (one request); a small tensor
    missing whole is cold: it goes to the daemon, and this rank, which knows nothing of
    the disk yet, waits for it."""
    path = cold_file(tmp_path / "small.safetensors", 8 * MiB, seed=9)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead past the first MiB
        assert len(os.pread(fd, MiB, 0)) == MiB  # "big" resident but for its last page
        os.posix_fadvise(fd, MiB - 4096, 4096, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    assert resident(path, 0, MiB) == MiB - 4096
    assert resident(path, 4 * MiB, 8192) == 0
    with running_daemon(*FLAGS, "--throttle", "16MiB") as daemon:
        client = Client(daemon.socket)
        ticket = client.request([span("big", path, 0, MiB), span("small", path, 4 * MiB, 8192)])
        assert ticket.wait_for_read("big", timeout=60) == "read"
        assert ticket.wait_for_read("small", timeout=60) == "ready"
        assert resident(path, 4 * MiB, 8192) == 8192  # ready means warm
        assert (ticket.progress.resident, ticket.progress.ready) == (1, 1)
        ticket.cancel()
        client.close()


def test_the_grant_tells_the_rate_before_any_plan(tmp_path: Path) -> None:
    """A rank learns the slowest mount's rate from its grant, before the plan comes:
    0 while the daemon knows nothing of the mount, the learned figure once it does."""
    first = cold_file(tmp_path / "first.safetensors", 16 * MiB, seed=9)
    with running_daemon(*FLAGS) as daemon:
        assert grant(daemon.socket, [str(first)], timeout=10).stream_bytes_per_s == 0.0
        client = Client(daemon.socket)
        ticket = client.request([span("w", first, 0, 16 * MiB)])
        assert ticket.wait(timeout=60)
        ticket.cancel()
        (learned,) = client.status()["mounts"]
        client.close()
        granted = grant(daemon.socket, [str(first)], timeout=10)
        assert granted.stream_bytes_per_s == learned["stream_bytes_per_s"] > 0


def test_a_rank_stops_waiting_for_a_daemon_that_is_not_ahead_of_it(tmp_path: Path) -> None:
    """The daemon knows the disk (16 MB/s per stream, from its state directory), so each
    16 MiB tensor is worth waiting about a second for; throttled to 1 MiB/s, it delivers
    none in time. After 8 waits that all ended with the rank reading itself, the rank
    reads at once, but for one wait in four (to notice a daemon that catches up)."""
    path = cold_file(tmp_path / "slow.safetensors", 16 * 16 * MiB, seed=10)
    state = learned_state(tmp_path / "state", path, 16e6)
    with running_daemon(*FLAGS, "--throttle", "1MiB", "--state-dir", str(state)) as daemon:
        took = timed_waits(daemon.socket, path, tensors=16, size=16 * MiB)
    assert all(t > 0.5 for t in took[:8]), took  # each waited about its read time (1 s)
    at_once = [t for t in took[8:] if t < 0.2]
    assert len(at_once) >= 5, took  # 6 of the next 8 did not wait


def test_a_rank_bounds_its_waits_by_its_own_reads(tmp_path: Path) -> None:
    """The daemon's figure (4 MB/s here, from its state directory) makes each 4 MiB tensor
    worth a second's wait; once the rank has timed four of its own reads of tensors that
    were not warm (``Ticket.took``: 1 ms each), it waits no longer than those took."""
    path = cold_file(tmp_path / "slow.safetensors", 8 * 4 * MiB, seed=11)
    state = learned_state(tmp_path / "state", path, 4e6)
    with running_daemon(*FLAGS, "--throttle", "64KiB", "--state-dir", str(state)) as daemon:
        took = timed_waits(daemon.socket, path, tensors=7, size=4 * MiB, own_read_s=0.001)
    assert all(t > 0.5 for t in took[:4]), took  # the daemon's bound: about a second each
    assert all(t < 0.2 for t in took[4:]), took  # this rank's own: a millisecond


def test_a_wait_shorter_than_a_thread_switch_is_not_begun(tmp_path: Path) -> None:
    """The daemon knows the disk at 1 GB/s, so reading a 1 MiB tensor here takes about a
    millisecond: less than the waiting thread would take to wake. The rank reads at once,
    with no bounded wait begun (none counts toward ``_daemon_behind``); a 64 MiB tensor
    (about 67 ms) is still waited for, and ends read when the throttled daemon is late."""
    path = cold_file(tmp_path / "fast.safetensors", 65 * MiB, seed=12)
    state = learned_state(tmp_path / "state", path, 1e9)
    with running_daemon(*FLAGS, "--throttle", "1MiB", "--state-dir", str(state)) as daemon:
        client = Client(daemon.socket)
        ticket = client.request([span("small", path, 0, MiB), span("big", path, MiB, 64 * MiB)])
        while not ticket.plan:  # the plan's figure, not only the grant's
            time.sleep(0.01)
        assert ticket.wait_for_read("small", timeout=60) == "read"
        assert not ticket.ready("small")  # not warm: read here, not reported ready
        assert list(ticket._waits) == []
        assert ticket.wait_for_read("big", timeout=60) == "read"
        assert list(ticket._waits) == [False]  # that one was waited for, and ended read
        ticket.cancel()
        client.close()


def _requested_after_eight_mib(daemon_socket: str, path: Path) -> tuple[Client, Any]:
    """A request of 16 tensors of 1 MiB, then 4 of 16 MiB, of ``path``, once the daemon
    has brought the 1 MiB ones: how fast it brings this request's tensors is known (8 MiB
    or more after its first event, which may bring several)."""
    client = Client(daemon_socket)
    small = [span(f"s{i}", path, i * MiB, MiB) for i in range(16)]
    big = [span(f"b{i}", path, 16 * MiB + i * 16 * MiB, 16 * MiB) for i in range(4)]
    ticket = client.request(small + big)
    assert ticket.wait([s.tensor for s in small], timeout=60)
    return client, ticket


def test_a_rank_does_not_wait_for_a_daemon_slower_than_its_own_reads(tmp_path: Path) -> None:
    """The daemon knows the disk at 64 MB/s a stream: reading a 16 MiB tensor here takes a
    quarter of a second. Throttled to 16 MiB/s, it has brought this request's first 16 MiB
    at that pace, so it would need a second for the last tensor: the rank reads it at
    once, with no bounded wait begun, and it is not reported ready."""
    path = cold_file(tmp_path / "ckpt.safetensors", 80 * MiB, seed=14)
    state = learned_state(tmp_path / "state", path, 64e6)
    with running_daemon(*FLAGS, "--throttle", "16MiB", "--state-dir", str(state)) as daemon:
        client, ticket = _requested_after_eight_mib(daemon.socket, path)
        assert ticket.wait_for_read("b3", timeout=60) == "read"
        assert list(ticket._waits) == []  # read at once, not after a bounded wait
        assert not ticket.ready("b3")
        ticket.cancel()
        client.close()


def test_a_rank_waits_for_a_daemon_faster_than_its_own_reads(tmp_path: Path) -> None:
    """The same request on a disk the daemon knows at 4 MB/s a stream (4 s to read a
    16 MiB tensor here), throttled to 64 MiB/s: at the pace it has brought the first
    16 MiB, the last tensor comes well within the rank's own read, so the rank waits for
    it, and it arrives warm."""
    path = cold_file(tmp_path / "ckpt.safetensors", 80 * MiB, seed=15)
    state = learned_state(tmp_path / "state", path, 4e6)
    with running_daemon(*FLAGS, "--throttle", "64MiB", "--state-dir", str(state)) as daemon:
        client, ticket = _requested_after_eight_mib(daemon.socket, path)
        if ticket.ready("b3"):
            pytest.skip("the daemon warmed every tensor before the rank asked")
        assert ticket.wait_for_read("b3", timeout=60) == "ready"
        # A bounded wait that ended warm (or none: warm between the check and the call).
        assert list(ticket._waits) in ([True], [])
        ticket.cancel()
        client.close()


def test_what_the_daemon_brought_is_not_counted_as_a_ranks_own_read(tmp_path: Path) -> None:
    """The daemon knows the disk at 16 MB/s: a 2 MiB tensor is worth 0.13 s of waiting.
    Throttled behind a 16 MiB tensor first in its order, it reaches none of the five
    small ones during the test; they are in the page cache all the same (read by
    another process after the request was checked, as the daemon's reads for another
    rank would put them there). The rank reads four of them itself after bounded waits,
    a millisecond each (``took``), but none of that millisecond was the storage's: the
    fifth is still waited for as long as the daemon's figure says, not read at once as
    by a rank whose own stream had brought 2 GB/s."""
    path = cold_file(tmp_path / "ckpt.safetensors", 32 * MiB, seed=16)
    state = learned_state(tmp_path / "state", path, 16e6)
    with running_daemon(*FLAGS, "--throttle", "1MiB", "--state-dir", str(state)) as daemon:
        client = Client(daemon.socket)
        small = [span(f"s{i}", path, 16 * MiB + i * 2 * MiB, 2 * MiB) for i in range(5)]
        ticket = client.request([span("big", path, 0, 16 * MiB), *small])
        while not ticket.plan:  # the residency check is over once the request went out
            time.sleep(0.01)
        with open(path, "rb") as f:
            f.seek(16 * MiB)
            f.read(10 * MiB)
        took = []
        for tensor in small:
            start = time.monotonic()
            assert ticket.wait_for_read(tensor.tensor, timeout=60) == "read"
            took.append(time.monotonic() - start)
            ticket.took(tensor.tensor, 0.001)
        ticket.cancel()
        client.close()
    assert all(t > 0.08 for t in took), took


def learned_state(state: Path, path: Path, bytes_per_s: float) -> Path:
    """A state directory in which a daemon learned ``bytes_per_s`` for ``path``'s mount."""
    state.mkdir(mode=0o700)
    figures = {"weighted_bytes": bytes_per_s * 1000, "weighted_seconds": 1000.0}
    figures["total_bytes"] = int(figures["weighted_bytes"])
    document = {"version": 1, "mounts": {mount_name(os.stat(path).st_dev): figures}}
    (state / "devices.json").write_text(json.dumps(document))
    os.chmod(state / "devices.json", 0o600)
    return state


def timed_waits(
    socket: str, path: Path, *, tensors: int, size: int, own_read_s: float | None = None
) -> list[float]:
    """Request ``tensors`` consecutive tensors of ``size`` bytes of ``path``; wait for each
    in turn (each must end "read") and return how long each wait took. ``own_read_s``:
    report that reading each took that long here (``Ticket.took``, as GatedReads does)."""
    client = Client(socket)
    names = [f"t{i}" for i in range(tensors)]
    ticket = client.request([span(n, path, i * size, size) for i, n in enumerate(names)])
    took = []
    for name in names:
        start = time.monotonic()
        assert ticket.wait_for_read(name, timeout=60) == "read"
        took.append(time.monotonic() - start)
        if own_read_s is not None:
            ticket.took(name, own_read_s)
    ticket.cancel()
    client.close()
    return took


def test_what_a_rank_reads_itself_is_read_in_at_once_and_exactly(tmp_path: Path) -> None:
    """The daemon knows the disk at 1 GB/s but is throttled to 1 MiB/s: the rank reads a
    16 MiB tensor itself. Before it does, it asks the kernel for exactly those bytes, so
    they are in the page cache within moments (the daemon alone would take 16 s), and
    nothing around them is (a fault would have read a read-ahead window around itself).
    The rank's descriptor for the hint closes with the request."""
    path = cold_file(tmp_path / "ckpt.safetensors", 64 * MiB, seed=13)
    state = learned_state(tmp_path / "state", path, 1e9)
    with running_daemon(*FLAGS, "--throttle", "1MiB", "--state-dir", str(state)) as daemon:
        client = Client(daemon.socket)
        before = len(os.listdir("/proc/self/fd"))
        ticket = client.request([span("a", path, 24 * MiB, 16 * MiB), span("b", path, 0, MiB)])
        while not ticket.plan:
            time.sleep(0.01)
        assert ticket.wait_for_read("a", timeout=60) == "read"
        answered = time.monotonic()
        while resident(path, 24 * MiB, 16 * MiB) < 16 * MiB and time.monotonic() < answered + 8:
            time.sleep(0.01)
        assert resident(path, 24 * MiB, 16 * MiB) == 16 * MiB  # the hint, not the daemon
        assert resident(path, 40 * MiB, 24 * MiB) == 0  # nothing past the tensor
        assert not ticket.ready("a")  # still not reported ready: the daemon did not warm it
        ticket.cancel()
        client.close()
    assert len(os.listdir("/proc/self/fd")) <= before


def test_the_daemon_skips_what_a_rank_has_read_itself(tmp_path: Path) -> None:
    """A rank that read tensors itself before they were ready (sooner than waiting) says
    so with its consumption reports: the daemon warms nothing more for them, and the
    request still ends. Throttled, the daemon needs a second per tensor; "c" and "d" are
    reported read at once, so it has not begun them."""
    path = cold_file(tmp_path / "ckpt.safetensors", 16 * MiB)
    names = ["a", "b", "c", "d"]
    tensors = [span(n, path, i * 4 * MiB, 4 * MiB) for i, n in enumerate(names)]
    with running_daemon(*FLAGS, "--throttle", "4MiB") as daemon:
        client = Client(daemon.socket)
        ticket = client.request(tensors)
        ticket.consumed(["c", "d"])  # as a rank reports its own reads (sent with the plan)
        assert ticket.progress.read == 2
        assert ticket.wait(timeout=60)  # "a" and "b" warm; nothing waits for "c" and "d"
        assert ticket.ready("a")
        assert ticket.ready("b")
        ticket.consumed(["a", "b"])
        assert ticket.finished.wait(timeout=30), "the request did not end"
        status = client.status()
        assert (ticket.progress.ready, ticket.progress.read) == (2, 2)
        assert status["bytes_read_total"] == 8 * MiB
        assert resident(path, 8 * MiB, 8 * MiB) == 0  # "c" and "d": never read
        client.close()


def test_a_resident_request_is_answered_before_request_returns(tmp_path: Path) -> None:
    """Every tensor in the page cache: the check runs in line on the caller's thread, so
    the ticket is finished when ``request`` returns, with no thread of its own and nothing
    sent (the daemon sees no rank). One tensor cold among them: the rest of the check and
    the request go to the ticket's thread, and the cold tensor is warmed."""
    files = [cold_file(tmp_path / f"r{i}.safetensors", 4 * MiB, seed=20 + i) for i in range(3)]
    for path in files:
        path.read_bytes()
    with running_daemon(*FLAGS) as daemon:
        client = Client(daemon.socket)
        tensors = [span(f"t{i}", path, 0, 4 * MiB) for i, path in enumerate(files)]
        before = {t.ident for t in threading.enumerate()}
        ticket = client.request(tensors)
        assert ticket.finished.is_set()  # already: no wait for any thread
        started = [t.name for t in threading.enumerate() if t.ident not in before]
        assert not [name for name in started if name.startswith("spanwarm")], started
        assert ticket.progress.resident == 3
        assert [ticket.wait_for_read(f"t{i}", timeout=1) for i in range(3)] == ["read"] * 3
        assert client.status()["ranks"] == []
        cold = cold_file(tmp_path / "cold.safetensors", 4 * MiB, seed=30)
        ticket = client.request([*tensors, span("c", cold, 0, 4 * MiB)])
        assert ticket.wait(timeout=60)
        progress = ticket.progress
        assert (progress.resident, progress.ready) == (3, 1)
        assert resident(cold, 0, 4 * MiB) == 4 * MiB
        ticket.cancel()
        client.close()


def test_tensors_read_before_the_request_went_out_are_hinted_too(tmp_path: Path) -> None:
    """A loader starts reading the moment request() returns, while the ticket's thread is
    still building and proving the request: those first cold reads are hinted exactly
    too. Unhinted, each fault through the loader's mapping reads a read-ahead window
    around itself (8 MiB on this VM's disk for a 1 MiB tensor)."""
    path = cold_file(tmp_path / "ckpt.safetensors", 64 * MiB, seed=17)
    state = learned_state(tmp_path / "state", path, 1e9)  # a 1 MiB read: 1 ms here
    names = [f"t{i}" for i in range(8)]
    with running_daemon(*FLAGS, "--throttle", "1MiB", "--state-dir", str(state)) as daemon:
        client = Client(daemon.socket)
        fd = os.open(path, os.O_RDONLY)
        try:
            with mmap.mmap(fd, 0, prot=mmap.PROT_READ) as mapping:
                ticket = client.request(
                    [span(n, path, i * 8 * MiB, MiB) for i, n in enumerate(names)]
                )
                for i, name in enumerate(names):
                    assert ticket.wait_for_read(name, timeout=60) in ("read", "ready")
                    _ = mapping[i * 8 * MiB : i * 8 * MiB + MiB]  # a copy: every page in
            time.sleep(0.2)  # any read-ahead the faults began lands meanwhile
            # Read in (the machine's idle reclaim may already have taken a page back):
            read = [resident_bytes(fd, i * 8 * MiB, MiB) for i in range(8)]
            assert all(n >= 0.995 * MiB for n in read), read
            gaps = [resident_bytes(fd, i * 8 * MiB + MiB, 7 * MiB) for i in range(8)]
            assert gaps == [0] * 8  # nothing around the tensors
        finally:
            os.close(fd)
        ticket.cancel()
        client.close()
