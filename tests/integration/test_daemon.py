"""A real daemon on a temporary socket, real files, real page cache."""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from spanwarm.checkpoint.safetensors_header import read_header
from spanwarm.client import Client, TensorSpans
from spanwarm.pagecache.residency import PAGE, evict, resident_bytes
from spanwarm.rpc.v1 import warmer_pb2, warmer_pb2_grpc
from tests.daemon_harness import cold_file, pinned, running_daemon

MiB = 2**20


def span(name: str, path: Path, offset: int, length: int) -> TensorSpans:
    return TensorSpans(name, str(path), offset, length, length, 1)


def resident(path: Path, offset: int, length: int) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        return resident_bytes(fd, offset, length)
    finally:
        os.close(fd)


def wait_for(predicate, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.02)


def test_two_ranks_share_reads_and_only_needed_bytes_get_warm(tmp_path: Path) -> None:
    path = cold_file(tmp_path / "ckpt.safetensors", 96 * MiB)
    os.posix_fadvise(os.open(path, os.O_RDONLY), 0, 0, os.POSIX_FADV_RANDOM)
    with running_daemon("--method", "read", "--seek-cost", "0", "--throttle", "64MiB") as daemon:
        a, b = (
            Client(daemon.socket, read_yourself=False),
            Client(daemon.socket, read_yourself=False),
        )
        rank0 = a.request(
            [span("a1", path, 0, 8 * MiB), span("a2", path, 8 * MiB, 16 * MiB)], rank=0
        )
        rank1 = b.request([span("b1", path, 16 * MiB, 24 * MiB)], rank=1)
        assert rank0.wait(timeout=30)
        assert rank1.wait(timeout=30)
        needed = 40 * MiB
        warm = resident(path, 0, needed)
        cold_tail = resident(path, 64 * MiB, 32 * MiB)
        status = a.status()
        assert rank0.progress.ready == 2
        assert rank1.progress.ready == 1
        a.close()
        b.close()
    assert warm >= needed * 0.995, warm
    assert cold_tail <= 32 * MiB * 0.05, cold_tail
    # The 8 MiB both ranks need is read from storage once (without dedupe: 48 MiB for 40);
    # 5% allows a re-read of pages this VM reclaimed in between.
    assert status["bytes_read_total"] <= needed * 1.05
    assert status["bytes_read_total"] + status["bytes_verified_total"] >= needed


def test_first_tensor_is_ready_long_before_the_last(tmp_path: Path) -> None:
    path = cold_file(tmp_path / "ckpt.safetensors", 32 * MiB)
    spans = [span(f"t{i}", path, i * 4 * MiB, 4 * MiB) for i in range(8)]
    # Two workers: t0 and t1 go first; the order of reads in flight together is up to the kernel.
    flags = ("--method", "read", "--throttle", "32MiB", "--chunk-size", "4MiB", "--workers", "2")
    with running_daemon(*flags) as daemon:
        client = Client(daemon.socket, read_yourself=False)
        start = time.monotonic()
        ticket = client.request(spans, rank=0)
        assert ticket.wait(["t0"], timeout=30)
        first = time.monotonic() - start
        assert not ticket.ready("t7")
        assert ticket.progress.ready < 8
        assert ticket.wait(timeout=30)
        total = time.monotonic() - start
        client.close()
    assert ticket.progress.ready == 8
    assert first < total / 2, (first, total)


def test_cells_go_in_the_order_of_the_request_across_files(tmp_path: Path) -> None:
    """A rank's second tensor in one file comes before its third in another: the order is
    the request's, not each file's own (which once sent every file's first cell ahead of
    any second one, so a load's first layer waited behind later layers' experts)."""
    a = cold_file(tmp_path / "a.safetensors", 24 * MiB)
    b = cold_file(tmp_path / "b.safetensors", 24 * MiB, seed=1)
    spans = [
        span("a0", a, 0, MiB),
        span("a1", a, 16 * MiB, MiB),
        span("b0", b, 0, MiB),
        span("a2", a, 8 * MiB, MiB),
    ]
    # One worker, one cell at a time, a quarter second each.
    flags = ("--method", "read", "--throttle", "4MiB", "--chunk-size", "4MiB", "--workers", "1")
    with running_daemon(*flags, "--seek-cost", "0") as daemon:
        client = Client(daemon.socket, read_yourself=False)
        ticket = client.request(spans, rank=0)
        order: list[str] = []
        deadline = time.monotonic() + 30
        while len(order) < len(spans) and time.monotonic() < deadline:
            order += [s.tensor for s in spans if s.tensor not in order and ticket.ready(s.tensor)]
            time.sleep(0.005)
        client.close()
    assert order == ["a0", "a1", "b0", "a2"], order


def test_a_late_rank_sharing_a_cell_still_gets_its_first_tensor(tmp_path: Path) -> None:
    # One worker. Rank 0's second tensor (cell 2) is in flight when rank 1 arrives needing
    # more of that cell plus a first tensor elsewhere; when the read completes, the cell
    # goes back to the front of rank 1's queue, ahead of its first tensor, which must
    # still go first (it once stalled there, held back by the first-tensors-first rule).
    path = cold_file(tmp_path / "ckpt.safetensors", 32 * MiB)
    flags = ("--method", "read", "--throttle", "4MiB", "--chunk-size", "4MiB", "--workers", "1")
    with running_daemon(*flags, "--seek-cost", "0") as daemon:
        early = Client(daemon.socket, read_yourself=False)  # every tensor goes to the daemon
        late = Client(daemon.socket, read_yourself=False)
        rank0 = early.request(
            [span("s0", path, 0, 64 * 1024), span("s1", path, 8 * MiB, 2 * MiB)], rank=0
        )
        assert rank0.wait(["s0"], timeout=30)
        rank1 = late.request(
            [span("r0", path, 20 * MiB, 64 * 1024), span("r1", path, 8 * MiB, 4 * MiB)], rank=1
        )
        assert rank1.wait(["r0"], timeout=20)
        assert rank1.wait(timeout=20)
        assert rank0.wait(timeout=20)
        assert rank1.progress.ready == 2
        early.close()
        late.close()


def test_a_rank_that_goes_away_releases_its_interest(tmp_path: Path) -> None:
    path = cold_file(tmp_path / "ckpt.safetensors", 64 * MiB)
    spans = [span(f"t{i}", path, i * 4 * MiB, 4 * MiB) for i in range(16)]
    flags = ("--method", "read", "--throttle", "16MiB", "--chunk-size", "4MiB", "--workers", "2")
    with running_daemon(*flags) as daemon:
        client = Client(daemon.socket, read_yourself=False)
        ticket = client.request(spans, rank=0)
        assert ticket.wait(["t0"], timeout=30)
        ticket.cancel()
        # Reads already in flight finish; nothing queued starts.
        wait_for(lambda: not client.status()["ranks"] and client.status()["in_flight"] == 0)
        status = client.status()
        assert status["queue_depth"] == 0
        assert status["files"] == []
        read_after_cancel = status["bytes_read_total"]
        time.sleep(0.5)
        assert client.status()["bytes_read_total"] == read_after_cancel
        client.close()
    assert read_after_cancel < 32 * MiB
    assert resident(path, 48 * MiB, 16 * MiB) < 16 * MiB * 0.1


def test_no_daemon_means_everything_released_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = cold_file(tmp_path / "f", 4 * MiB)
    client = Client(str(tmp_path / "nobody.sock"), timeout=2)
    with caplog.at_level(logging.WARNING, logger="spanwarm.client"):
        ticket = client.request([span("x", path, 0, MiB), span("y", path, MiB, MiB)], rank=0)
        assert ticket.wait(timeout=10)
        assert ticket.finished.wait(5)
    assert ticket.progress.failed == 2
    assert ticket.progress.ready == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "UNAVAILABLE" in warnings[0]


def test_disabled_client_is_a_no_op(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPANWARM_DISABLE", "1")
    ticket = Client(str(tmp_path / "nobody.sock")).request([span("x", tmp_path / "f", 0, 1)])
    assert ticket.ready("x")
    assert ticket.wait(timeout=0)


def test_daemon_killed_mid_warm_releases_the_job(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = cold_file(tmp_path / "f", 32 * MiB)
    with running_daemon("--method", "read", "--throttle", "4MiB", "--chunk-size", "1MiB") as daemon:
        client = Client(daemon.socket, read_yourself=False)
        with caplog.at_level(logging.WARNING, logger="spanwarm.client"):
            ticket = client.request([span(f"t{i}", path, i * MiB, MiB) for i in range(32)], rank=0)
            assert ticket.wait(["t0"], timeout=30)
            daemon.process.kill()
            assert ticket.wait(timeout=10)
            assert ticket.finished.wait(5)
        client.close()
    assert 1 <= ticket.progress.ready < 32
    assert any("UNAVAILABLE" in r.getMessage() for r in caplog.records)


def test_an_error_answer_releases_the_job(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = cold_file(tmp_path / "f", MiB)
    with running_daemon() as daemon, caplog.at_level(logging.WARNING, logger="spanwarm.client"):
        client = Client(daemon.socket, read_yourself=False)
        ticket = client.request([span("x", path, 0, 2 * MiB)], rank=0)
        assert ticket.wait(timeout=10)
        client.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "OUT_OF_RANGE" in warnings[0]
    assert str(path) in warnings[0]


def _request(
    files: list[str], spans: list[tuple[int, int, int, int, int]], **fields: object
) -> warmer_pb2.WarmRequest:
    request = warmer_pb2.WarmRequest(job="t", rank=0, files=files, groups=["g"])
    for file_index, offset, length, stride, count in spans:
        request.file_index.append(file_index)
        request.offset.append(offset)
        request.length.append(length)
        request.stride.append(stride)
        request.count.append(count)
        request.group_index.append(0)
    for name, value in fields.items():
        getattr(request, name)[:] = value
    return request


def test_bad_input_gets_its_own_status_code_and_the_daemon_keeps_serving(tmp_path: Path) -> None:
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    good = cold_file(allowed / "good", MiB)
    outside = cold_file(tmp_path / "outside", MiB)
    (allowed / "escape").symlink_to(outside)
    os.mkfifo(allowed / "fifo")
    (allowed / "dir").mkdir()
    g, one = str(good), (0, 0, 10, 10, 1)
    cases = [
        (
            "ragged columns",
            _request([g], [one], length=[1, 2]),
            "INVALID_ARGUMENT",
            "differ in length",
        ),
        ("relative path", _request(["rel/file"], [one]), "INVALID_ARGUMENT", "must be absolute"),
        ("file index", _request([g], [(3, 0, 1, 1, 1)]), "INVALID_ARGUMENT", "file_index 3"),
        ("group index", _request([g], [one], group_index=[5]), "INVALID_ARGUMENT", "group_index 5"),
        (
            "outside roots",
            _request([str(outside)], [one]),
            "PERMISSION_DENIED",
            "outside the allowed roots",
        ),
        (
            "symlink escape",
            _request([str(allowed / "escape")], [one]),
            "PERMISSION_DENIED",
            str(outside),
        ),
        ("missing", _request([str(allowed / "nope")], [one]), "NOT_FOUND", "no such file"),
        (
            "fifo",
            _request([str(allowed / "fifo")], [one]),
            "FAILED_PRECONDITION",
            "not a regular file",
        ),
        (
            "directory",
            _request([str(allowed / "dir")], [one]),
            "FAILED_PRECONDITION",
            "not a regular file",
        ),
        (
            "past the end",
            _request([g], [(0, MiB - 4, 8, 8, 1)]),
            "OUT_OF_RANGE",
            f"{g}: span 0 ends at",
        ),
        (
            "strided past the end",
            _request([g], [(0, 0, 8, MiB // 2, 3)]),
            "OUT_OF_RANGE",
            "past the end",
        ),
        (
            "too many spans",
            _request([g], [one] * 11),
            "RESOURCE_EXHAUSTED",
            "11 spans exceed the limit of 10",
        ),
        (
            "too many files",
            _request([g, g, g], [one]),
            "RESOURCE_EXHAUSTED",
            "3 files exceed the limit of 2",
        ),
    ]
    flags = ("--allow", str(allowed), "--max-spans", "10", "--max-files", "2")
    with (
        running_daemon(*flags) as daemon,
        grpc.insecure_channel(f"unix:{daemon.socket}") as channel,
    ):
        stub = warmer_pb2_grpc.WarmerStub(channel)
        for label, request, code, fragment in cases:
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Warm(request, timeout=10))
            assert info.value.code().name == code, label
            assert fragment in (info.value.details() or ""), (label, info.value.details())
        call = stub.Warm(_request([g], [one]), timeout=10)
        events = []
        for event in call:
            events.append(event)
            if event.HasField("done"):  # report the tensor read: the stream then ends
                consumed = warmer_pb2.ConsumedRequest(
                    request_id=events[0].plan.request_id, groups=[0]
                )
                stub.Consumed(consumed, timeout=5)
        status = stub.Status(warmer_pb2.StatusRequest(), timeout=5)
    assert events[0].HasField("plan")
    assert events[-1].HasField("done")
    assert events[-1].done.ready == 1
    assert status.version


def test_a_file_that_shrinks_fails_its_groups_only(tmp_path: Path) -> None:
    shrinking = cold_file(tmp_path / "a", 16 * MiB)
    steady = cold_file(tmp_path / "b", 16 * MiB, seed=1)
    spans = [span(f"a{i}", shrinking, i * MiB, MiB) for i in range(16)]
    spans += [span(f"b{i}", steady, i * MiB, MiB) for i in range(16)]
    with running_daemon("--method", "read", "--throttle", "8MiB", "--chunk-size", "1MiB") as daemon:
        client = Client(daemon.socket, read_yourself=False)
        ticket = client.request(spans, rank=0)
        assert ticket.wait(["a0"], timeout=30)
        os.truncate(shrinking, 4 * MiB)
        assert ticket.wait(timeout=60)
        client.close()
    failed = set(ticket.failures)
    assert failed
    assert all(name.startswith("a") for name in failed)
    assert all(
        "ABORTED" in reason and str(shrinking) in reason for reason in ticket.failures.values()
    )
    assert all(ticket.ready(f"b{i}") for i in range(16))
    assert ticket.progress.ready >= 16


def test_a_resident_file_changed_in_place_is_not_reported_warm(tmp_path: Path) -> None:
    """Pages in the page cache are not warm for a request once their file changed after
    it was admitted: rewritten in place, every page stays resident (with the new bytes),
    and the daemon, which reads nothing there, must still notice."""
    busy = cold_file(tmp_path / "busy", 8 * MiB)
    resident = cold_file(tmp_path / "resident", 8 * MiB, seed=1)
    fd = os.open(resident, os.O_RDONLY)
    # Pinned, so that the VM's reclaim of idle cache cannot send the daemon down the path
    # that reads, where the change would be noticed anyway.
    try:
        with pinned(fd, 0, 8 * MiB):
            assert resident_bytes(fd, 0, 8 * MiB) == 8 * MiB
            _changed_while_queued(busy, resident)
            assert resident_bytes(fd, 0, 8 * MiB) == 8 * MiB  # all there to be verified
    finally:
        os.close(fd)


def _changed_while_queued(busy: Path, resident: Path) -> None:
    """Request ``resident`` behind ``busy``'s throttled cells, rewrite it in place once
    admitted; at most the one cell verified before the rewrite is ready."""
    flags = ("--method", "read", "--throttle", "1MiB", "--chunk-size", "1MiB", "--workers", "1")
    with running_daemon(*flags) as daemon:
        client = Client(daemon.socket, read_yourself=False)  # resident: still asked for
        # One worker, held a second per cell by the throttled cold file.
        hog = client.request([span(f"busy{i}", busy, i * MiB, MiB) for i in range(8)], rank=0)
        assert hog.wait(["busy0"], timeout=30)
        ticket = client.request([span(f"r{i}", resident, i * MiB, MiB) for i in range(8)], rank=1)
        deadline = time.monotonic() + 30
        while not ticket.plan and time.monotonic() < deadline:  # admitted: identity taken
            time.sleep(0.005)
        assert ticket.plan
        with open(resident, "r+b") as f:
            f.write(b"changed")  # same size; a new mtime; every page still resident
        os.utime(resident, ns=(time.time_ns(), time.time_ns() + 10**9))
        assert ticket.wait(timeout=60)
        hog.cancel()
        client.close()
    # The worker may have verified one cell before the rewrite; none after it.
    assert sum(ticket.ready(f"r{i}") and f"r{i}" not in ticket.failures for i in range(8)) <= 1
    assert len(ticket.failures) >= 7, ticket.failures
    assert all("ABORTED" in why and str(resident) in why for why in ticket.failures.values())


def test_sigterm_drains_and_exits_0_with_systemd_notifications(tmp_path: Path) -> None:
    path = cold_file(tmp_path / "f", 8 * MiB)
    with running_daemon("--method", "read", "--throttle", "8MiB", "--chunk-size", "1MiB") as daemon:
        mode = stat.S_IMODE(os.stat(daemon.socket).st_mode)
        with grpc.insecure_channel(f"unix:{daemon.socket}") as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
        client = Client(daemon.socket, read_yourself=False)
        ticket = client.request([span(f"t{i}", path, i * MiB, MiB) for i in range(8)], rank=0)
        assert ticket.wait(["t0"], timeout=30)
        results: dict[str, bool] = {}
        waiter = threading.Thread(target=lambda: results.setdefault("all", ticket.wait(timeout=30)))
        waiter.start()
        assert daemon.stop() == 0
        waiter.join(30)
        client.close()
        notes = daemon.read_notifications(0.5)
        socket_left = os.path.exists(daemon.socket)
    assert mode == 0o600
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert notes[:1] == ["READY=1"]
    assert "STOPPING=1" in notes
    assert results["all"]
    assert ticket.progress.ready == 8  # the open stream was drained
    assert not socket_left


def test_a_daemon_stopped_as_its_ranks_go_exits_0_every_time(tmp_path: Path) -> None:
    """Ranks cancel their streams with reads in flight while SIGTERM arrives, 15 times: exit
    status 0 each time. (The interpreter's teardown after a clean stop aborted the daemon,
    SIGABRT from grpc's threads, in 5 of 40 such stops: scripts/stop_repeatedly.py.)"""
    sparse = tmp_path / "sparse"
    with open(sparse, "wb") as f:
        f.truncate(64 * 2**30)
    statuses = []
    for _ in range(15):
        flags = ("--throttle", "64MiB", "--drain-seconds", "0", "--log-level", "error")
        with running_daemon(*flags) as daemon:
            clients = [Client(daemon.socket, read_yourself=False) for _ in range(8)]
            for rank, client in enumerate(clients):
                spans = [span(f"t{i}", sparse, (i * 8 + rank) * 8 * MiB, 4096) for i in range(500)]
                client.request(spans, rank=rank)
            time.sleep(0.3)
            for client in clients:
                client.close()
            statuses.append(daemon.stop())
    assert statuses == [0] * 15


def test_a_supervisor_gone_does_not_stop_a_clean_shutdown(tmp_path: Path) -> None:
    state = tmp_path / "state"
    path = cold_file(tmp_path / "f", 16 * MiB)
    with running_daemon("--method", "read", "--state-dir", str(state)) as daemon:
        client = Client(daemon.socket, read_yourself=False)
        assert client.request([span("t", path, 0, 16 * MiB)]).wait(timeout=30)
        client.close()
        # The notification socket goes away, as when a supervisor dies or restarts.
        address = daemon.notify.getsockname()
        daemon.notify.close()
        os.unlink(address)
        assert daemon.stop() == 0
        socket_left = os.path.exists(daemon.socket)
    assert not socket_left
    assert (state / "devices.json").exists()  # what it learned was kept on the way out


def test_a_second_daemon_on_the_same_socket_is_refused(tmp_path: Path) -> None:
    with running_daemon() as daemon:
        import subprocess
        import sys

        second = subprocess.run(
            [sys.executable, "-m", "spanwarm", "serve", "--socket", daemon.socket],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    assert second.returncode == 1
    assert "another daemon is already serving" in second.stderr


@pytest.mark.parametrize("method", ["populate", "read", "hint"])
def test_each_warm_method_makes_exactly_the_spans_resident(tmp_path: Path, method: str) -> None:
    path = cold_file(tmp_path / "f", 48 * MiB)
    spans = [span("a", path, 0, 6 * MiB), span("b", path, 8 * MiB + 4096, 5 * MiB)]
    with running_daemon("--method", method, "--seek-cost", "0") as daemon:
        client = Client(daemon.socket, read_yourself=False)
        ticket = client.request(spans, rank=0)
        assert ticket.wait(timeout=30)
        first, second = resident(path, 0, 6 * MiB), resident(path, 8 * MiB + 4096, 5 * MiB)
        tail = resident(path, 24 * MiB, 24 * MiB)
        status = client.status()
        client.close()
    assert ticket.progress.ready == 2
    assert status["method"] == method
    assert first >= 6 * MiB * 0.995
    assert second >= 5 * MiB * 0.995
    assert tail <= 24 * MiB * 0.05


def test_status_and_warm_commands(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    path = cold_file(tmp_path / "f", 8 * MiB)
    with running_daemon() as daemon:
        spanwarm = [sys.executable, "-m", "spanwarm"]
        warm = subprocess.run(
            [*spanwarm, "warm", f"{path}:1MiB:2MiB", str(path), "--socket", daemon.socket],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        status = subprocess.run(
            [*spanwarm, "status", "--json", "--socket", daemon.socket],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        table = subprocess.run(
            [*spanwarm, "status", "--socket", daemon.socket],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
    gone = subprocess.run(
        [*spanwarm, "status", "--socket", daemon.socket],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert warm.returncode == 0, warm.stderr
    assert "warmed 2 of 2 targets, 10.0 MiB" in warm.stdout
    assert f"{path}: whole" in warm.stdout
    document = json.loads(status.stdout)
    assert document["bytes_read_total"] + document["bytes_verified_total"] >= 8 * MiB
    assert document["ranks"] == []
    assert "planned" in table.stdout
    assert gone.returncode == 1
    assert "no daemon answering" in gone.stderr


def test_request_spans_warms_a_ranks_dtensor_slices(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    path = tmp_path / "model.safetensors"
    save_file({"w": torch.zeros(4096, 2048, dtype=torch.bfloat16)}, str(path))  # 16 MiB
    evict(path)
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    try:
        mesh = init_device_mesh("cpu", (4,))
        meta = torch.empty(4096, 2048, dtype=torch.bfloat16, device="meta")
        state = {"w": distribute_tensor(meta, mesh, [Shard(0)], src_data_rank=None)}
        with running_daemon("--method", "read", "--seek-cost", "0") as daemon:
            client = Client(daemon.socket, read_yourself=False)
            ticket = client.request_spans(state, path, job="job-a")
            assert ticket.wait(timeout=30)
            data_start = read_header(path).data_start
            mine = resident(path, data_start + 4 * MiB, 4 * MiB)
            others = resident(path, data_start + 10 * MiB, 6 * MiB)
            # safetensors' get_slice faults in the tensor's first page whatever rows it
            # copies: asked for and warmed too, and nothing around it.
            first_page = resident(path, data_start, 1)  # 1: its page is in
            between = resident(path, data_start + 64 * 2**10, 3 * MiB)
            client.close()
    finally:
        dist.destroy_process_group()
    assert ticket.progress.ready == 1
    touch = PAGE - data_start % PAGE  # the tensor's bytes in the page of its first byte
    assert ticket.plan[0]["needed_bytes"] == 4 * MiB + touch
    assert mine >= 4 * MiB * 0.995
    assert first_page == 1
    assert between == 0
    assert others <= 6 * MiB * 0.05


def test_group_socket_tcp_health_and_reflection(tmp_path: Path) -> None:
    import grp
    import socket as socketlib

    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with socketlib.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    group = grp.getgrgid(os.getgid()).gr_name
    flags = ("--socket-group", group, "--allow", str(tmp_path), "--listen", f"127.0.0.1:{port}")
    with running_daemon(*flags) as daemon:
        st = os.stat(daemon.socket)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as tcp:
            health = health_pb2_grpc.HealthStub(tcp).Check(
                health_pb2.HealthCheckRequest(service="spanwarm.v1.Warmer"), timeout=5
            )
        with grpc.insecure_channel(f"unix:{daemon.socket}") as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            request = reflection_pb2.ServerReflectionRequest(list_services="")
            (reply,) = list(stub.ServerReflectionInfo(iter([request]), timeout=5))
    assert stat.S_IMODE(st.st_mode) == 0o660
    assert st.st_gid == os.getgid()
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    services = {s.name for s in reply.list_services_response.service}
    assert {"spanwarm.v1.Warmer", "grpc.health.v1.Health"} <= services


def test_status_watch_runs_until_interrupted(tmp_path: Path) -> None:
    import signal as signals
    import subprocess
    import sys

    with running_daemon() as daemon:
        watch = subprocess.Popen(
            [sys.executable, "-m", "spanwarm", "status", "--watch", "--socket", daemon.socket],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        # Interrupted once it is talking to the daemon (its imports may take seconds on a
        # fresh checkout), whether in a call or between two: it ends, and says what it saw.
        deadline = time.monotonic() + 60
        while not _connected(watch.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        watch.send_signal(signals.SIGINT)
        out, err = watch.communicate(timeout=30)
    assert watch.returncode == 0, err
    assert "planned" in out


def _connected(pid: int) -> bool:
    """Whether process ``pid`` holds a socket (its channel to the daemon)."""
    try:
        fds = Path(f"/proc/{pid}/fd").iterdir()
        return any(os.readlink(fd).startswith("socket:") for fd in fds)
    except OSError:  # it exited, or a descriptor closed while looked at
        return False


def test_files_are_closed_when_requests_end_even_when_named_twice(tmp_path: Path) -> None:
    path = cold_file(tmp_path / "f", 2 * MiB)
    alias = tmp_path / "alias"
    alias.symlink_to(path)  # another name for the same file: two table entries, one open file

    def open_fds(pid: int) -> int:
        fds = Path(f"/proc/{pid}/fd")
        return sum(1 for fd in fds.iterdir() if os.path.realpath(fd) == str(path))

    with running_daemon("--method", "read") as daemon:
        client = Client(daemon.socket, read_yourself=False)
        ticket = client.request([span("a", path, 0, MiB), span("b", alias, MiB, MiB)], rank=0)
        assert ticket.wait(timeout=30)
        assert open_fds(daemon.process.pid) == 1
        ticket.consumed(["a", "b"])
        assert ticket.finished.wait(10)  # the stream ended: the request is gone
        wait_for(lambda: open_fds(daemon.process.pid) == 0)
        client.close()


def test_many_ranks_with_overlapping_spans_arriving_together_all_get_ready(
    tmp_path: Path,
) -> None:
    # Ranks join while other ranks' reads of the cells they share are in flight, so cells
    # are re-queued in front of their first tensors; a rank once stalled there for good
    # (every rank, 16 of 16, waited until its hold expired).
    import numpy as np

    paths = [cold_file(tmp_path / f"f{i}", 64 * MiB, seed=i) for i in range(4)]

    def rank_spans(rank: int) -> list[TensorSpans]:
        rng = np.random.default_rng(rank)
        out = []
        for i in range(2000):
            length = int(rng.integers(1, 17)) * 4096
            offset = int(rng.integers(0, (64 * MiB - length) // 4096)) * 4096
            path = paths[int(rng.integers(4))]
            out.append(TensorSpans(f"t{i // 10}", str(path), offset, length, length, 1))
        return out

    with running_daemon("--method", "read") as daemon:
        client = Client(daemon.socket, stall_timeout=120, read_yourself=False)
        tickets = [client.request(rank_spans(rank), rank=rank) for rank in range(16)]
        assert all(ticket.wait(timeout=60) for ticket in tickets)
        for ticket in tickets:
            ticket.cancel()
        client.close()
    assert [t.progress.ready for t in tickets] == [200] * 16


def test_a_load_cancelled_right_after_its_last_report_leaves_no_thread(tmp_path: Path) -> None:
    """A loader done with its tensors cancels at once: a release landing while the
    reporting thread waited out its batch delay was cleared by it, and the thread then
    waited for good, holding the ticket (7 of 8 loads left one, found by an attack run)."""
    path = cold_file(tmp_path / "f", 4 * MiB)
    spans = [span(f"t{i}", path, i * MiB, MiB) for i in range(4)]
    earlier = set(threading.enumerate())  # other tests' loads may still be winding down
    with running_daemon("--method", "read") as daemon:
        client = Client(daemon.socket)
        for _ in range(8):
            evict(path)
            ticket = client.request(spans, rank=0)
            fd = os.open(path, os.O_RDONLY)
            try:
                for s in spans:
                    ticket.wait_for_read(s.tensor, timeout=30)
                    os.pread(fd, s.length, s.offset)
                    ticket.consumed([s.tensor])
            finally:
                os.close(fd)
            ticket.cancel()
            assert ticket.finished.wait(10)
        client.close()

        def reporters() -> int:
            return sum(
                t.name == "spanwarm-reports" and t not in earlier for t in threading.enumerate()
            )

        deadline = time.monotonic() + 10
        while reporters() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert reporters() == 0


def test_names_reach_the_status_table_as_plain_escaped_text(tmp_path: Path) -> None:
    """A job or file name is the user's: terminal escapes, markup, links and line breaks in
    it reach root's ``spanwarm status`` written out, never acted on."""
    import subprocess
    import sys

    hostile = "\x1b]0;owned\x07\x1b[2J\n[red]fake row [link=x]y\u202e"  # a file name: no "/"
    path = cold_file(tmp_path / f"f{hostile}.bin", MiB)
    with running_daemon() as daemon:
        client = Client(daemon.socket, read_yourself=False)
        ticket = client.request([TensorSpans("t", str(path), 0, MiB, MiB, 1)], job=hostile)
        assert ticket.wait(timeout=30)
        table = subprocess.run(
            [sys.executable, "-m", "spanwarm", "status", "--socket", daemon.socket],
            capture_output=True,
            timeout=60,
            check=True,
            env={**os.environ, "COLUMNS": "400", "FORCE_COLOR": "1"},
        )
        ticket.cancel()
        client.close()
    out = table.stdout.decode()
    shown = "\\x1b]0;owned\\x07\\x1b[2J\\n[red]fake row [link=x]y\\u202e"
    assert out.count(shown) == 2  # the job in the ranks table, the file in the files table
    assert "\x07" not in out
    assert "\u202e" not in out
    assert "\x1b]" not in out  # no OSC: no title, no hyperlink
    assert "\x1b[2J" not in out
    assert not any(line.startswith("[red]fake row") for line in out.splitlines())


@pytest.mark.parametrize("change", ["replaced", "deleted", "moved out"])
def test_a_file_replaced_deleted_or_moved_out_while_warmed_fails_not_ready(
    tmp_path: Path, change: str
) -> None:
    """A loader opens the checkpoint by its name: once that name is another file (or none,
    or the file left the allowed roots), warming the old inode warms nothing it reads.
    Its tensors not yet warm fail with ABORTED, naming the cause; none is ready after."""
    allowed = tmp_path / "ckpt"
    allowed.mkdir()
    path = cold_file(allowed / "model.safetensors", 64 * MiB)
    flags = ("--method", "read", "--throttle", "16MiB", "--workers", "1", "--allow", str(allowed))
    with running_daemon(*flags) as daemon:
        client = Client(daemon.socket, read_yourself=False)
        ticket = client.request([span(f"t{i}", path, i * 4 * MiB, 4 * MiB) for i in range(16)])
        assert ticket.wait(["t0"], timeout=30)  # warming is under way
        if change == "replaced":
            cold_file(allowed / "new.safetensors", 64 * MiB, seed=1)
            os.rename(allowed / "new.safetensors", path)
        elif change == "deleted":
            os.unlink(path)
        else:
            os.rename(path, tmp_path / "elsewhere.safetensors")
        assert ticket.wait(timeout=60)
        failures = dict(ticket.failures)
        ready = ticket.progress.ready
        ticket.cancel()
        client.close()
    assert ready < 16
    assert len(failures) == 16 - ready, failures
    cause = "outside the allowed roots" if change == "moved out" else "deleted or replaced"
    assert all(cause in reason for reason in failures.values()), failures
    assert all(reason.startswith(f"ABORTED: {path}: ") for reason in failures.values())
