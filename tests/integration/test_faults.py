"""Faults a real daemon must survive: storage that fails or hangs, and a daemon that freezes.

The storage is spanwarm.testing.slowfs (a real FUSE file system) with its fault and hang knobs; the
daemon is a real child process. These run in CI (make test installs fuse3 as root).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from spanwarm.client import Client, TensorSpans
from spanwarm.pagecache.residency import evict, resident_bytes
from spanwarm.rpc.v1 import warmer_pb2, warmer_pb2_grpc
from spanwarm.testing.slowfs import Fault, Hang, SlowFS, fuse_available, mount
from tests.daemon_harness import cold_file, running_daemon

MiB = 2**20
KiB = 2**10


def _mounted(tmp_path: Path, **knobs: list[Fault] | list[Hang]) -> Iterator[SlowFS]:
    reason = fuse_available()
    if reason is not None:
        pytest.skip(reason)
    source = tmp_path / "src"
    source.mkdir()
    cold_file(source / "ckpt.safetensors", 32 * MiB)
    with mount(source, tmp_path / "mnt", "local", **knobs) as fs:  # type: ignore[arg-type]
        evict(fs.path("ckpt.safetensors"))
        yield fs


def _tensors(path: Path, size: int, n: int) -> list[TensorSpans]:
    step = size // n
    return [TensorSpans(f"t{i}", str(path), i * step, step, step, 1) for i in range(n)]


# The bad range sits inside t20's MiB (64 KiB past its start), away from its edges.
BAD_START, BAD_LENGTH = 20 * MiB + 64 * KiB, 64 * KiB


@pytest.fixture
def faulty(tmp_path: Path) -> Iterator[SlowFS]:
    yield from _mounted(tmp_path, faults=[Fault("ckpt.safetensors", BAD_START, BAD_LENGTH)])


@pytest.mark.parametrize("method", ["populate", "read", "hint"])
def test_an_io_error_fails_only_the_tensor_on_the_bad_bytes(faulty: SlowFS, method: str) -> None:
    path = faulty.path("ckpt.safetensors")
    tensors = _tensors(path, 32 * MiB, 32)  # 1 MiB each: the 8 MiB cell holds t16..t23
    with running_daemon("--method", method, "--seek-cost", "0") as daemon:
        client = Client(daemon.socket, read_yourself=False)
        ticket = client.request(tensors, rank=0)
        assert ticket.wait(timeout=60)
        fd = os.open(path, os.O_RDONLY)
        try:
            resident = {t.tensor: resident_bytes(fd, t.offset, t.length) for t in tensors}
        finally:
            os.close(fd)
        with grpc.insecure_channel(f"unix:{daemon.socket}") as channel:
            status = warmer_pb2_grpc.WarmerStub(channel).Status(
                warmer_pb2.StatusRequest(), timeout=5
            )
        client.close()
    assert set(ticket.failures) == {"t20"}, ticket.failures
    reason = ticket.failures["t20"]
    assert reason.startswith("UNAVAILABLE: ")
    assert "Input/output error" in reason
    assert str(path) in reason
    offset = int(reason.rsplit("at offset ", 1)[1].rstrip(")"))
    assert BAD_START <= offset < BAD_START + BAD_LENGTH
    assert ticket.progress.ready == 31
    # The rest of the cell around the bad range was warmed, not given up on.
    for name in ("t16", "t19", "t21", "t23", "t0", "t31"):
        assert resident[name] >= MiB * 0.99, (name, resident[name])
    assert status.version  # the daemon still answers


@pytest.fixture
def hung(tmp_path: Path) -> Iterator[SlowFS]:
    yield from _mounted(tmp_path, hangs=[Hang("ckpt.safetensors", 20.0)])


def test_sigterm_is_bounded_while_a_storage_read_hangs(hung: SlowFS) -> None:
    path = hung.path("ckpt.safetensors")
    drain = 3.0
    with running_daemon("--method", "read", "--drain-seconds", str(drain)) as daemon:
        client = Client(daemon.socket, read_yourself=False)
        ticket = client.request(_tensors(path, 32 * MiB, 8), rank=0)
        deadline = time.monotonic() + 20
        while client.status()["in_flight"] == 0:  # a worker is stuck in the hung read
            assert time.monotonic() < deadline
            time.sleep(0.05)
        started = time.monotonic()
        code = daemon.stop(timeout=60)
        took = time.monotonic() - started
        assert ticket.wait(timeout=10)  # the stream ended: the rank reads cold
        client.close()
    print(f"SIGTERM to exit with a read hung: {took:.2f} s (drain {drain} s)")
    assert code == 0
    # The bound is drain + 2 s; the slack is for this noisy VM's scheduling.
    assert took < drain + 2 + 2, took


def test_a_frozen_daemon_releases_the_job(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = cold_file(tmp_path / "f", 32 * MiB)
    flags = ("--method", "read", "--throttle", "4MiB", "--chunk-size", "1MiB")
    with running_daemon(*flags) as daemon, caplog.at_level(logging.WARNING, "spanwarm.client"):
        client = Client(
            daemon.socket, read_yourself=False
        )  # defaults: keepalive and a 30 s stall timeout
        ticket = client.request(_tensors(path, 32 * MiB, 32), rank=0)
        assert ticket.wait(["t0"], timeout=30)
        daemon.process.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            waiter = threading.Thread(target=ticket.wait)  # no timeout, as the README shows
            waiter.start()
            waiter.join(45)
            took = time.monotonic() - started
            released = not waiter.is_alive()
        finally:
            daemon.process.send_signal(signal.SIGCONT)
        client.close()
    print(f"frozen daemon: Ticket.wait() returned after {took:.1f} s")
    assert released, "Ticket.wait() still blocked 45 s after the daemon froze"
    assert took < 30, took  # keepalive: about 15 s; the stall watchdog would take 30
    assert 1 <= ticket.progress.ready < 32
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings


def test_a_daemon_that_makes_no_progress_is_given_up_on(
    hung: SlowFS, caplog: pytest.LogCaptureFixture
) -> None:
    # The daemon is alive (heartbeats arrive) but its storage read hangs: nothing moves.
    path = hung.path("ckpt.safetensors")
    with (
        running_daemon("--method", "read", "--drain-seconds", "0") as daemon,
        caplog.at_level(logging.WARNING, "spanwarm.client"),
    ):
        client = Client(daemon.socket, stall_timeout=3.0, read_yourself=False)
        started = time.monotonic()
        ticket = client.request(_tensors(path, 32 * MiB, 4), rank=0)
        assert ticket.wait(timeout=30)
        took = time.monotonic() - started
        client.close()
    assert ticket.progress.ready == 0
    assert ticket.progress.failed == 4
    assert took >= 3.0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "no progress" in warnings[0]
