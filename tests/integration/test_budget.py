"""The memory budget: a sliding window in consumption order, and where its default comes from."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from spanwarm.client import Client, TensorSpans
from spanwarm.daemon.budget import available_memory, cgroup_room, parse_budget
from spanwarm.pagecache.residency import resident_bytes
from tests.daemon_harness import cold_file, running_daemon

MiB = 2**20


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_room_is_limit_minus_working_set(tmp_path: Path) -> None:
    write(tmp_path / "proc_cgroup", "0::/kubepods/pod1/spanwarm\n")
    group = tmp_path / "cg" / "kubepods" / "pod1" / "spanwarm"
    write(group / "memory.max", f"{8 * 2**30}\n")
    write(group / "memory.current", f"{3 * 2**30}\n")
    write(group / "memory.stat", f"anon 123\ninactive_file {2**30}\nactive_file 5\n")
    write(tmp_path / "meminfo", "MemTotal: 100 kB\nMemAvailable:   20971520 kB\n")  # 20 GiB
    assert cgroup_room(tmp_path / "cg", tmp_path / "proc_cgroup") == 6 * 2**30
    assert (
        available_memory(tmp_path / "meminfo", tmp_path / "cg", tmp_path / "proc_cgroup")
        == 6 * 2**30
    )


def test_cgroup_v1_and_unlimited(tmp_path: Path) -> None:
    write(tmp_path / "proc_cgroup", "4:memory:/job\n0::/\n")
    write(tmp_path / "cg" / "memory" / "job" / "memory.limit_in_bytes", f"{2**30}\n")
    write(tmp_path / "cg" / "memory" / "job" / "memory.usage_in_bytes", f"{2**29}\n")
    write(tmp_path / "cg" / "memory" / "job" / "memory.stat", "total_inactive_file 0\n")
    write(tmp_path / "cg" / "memory.max", "max\n")  # v2 root: unlimited
    write(tmp_path / "meminfo", "MemAvailable:   20971520 kB\n")
    assert cgroup_room(tmp_path / "cg", tmp_path / "proc_cgroup") == 2**29
    assert (
        available_memory(tmp_path / "meminfo", tmp_path / "cg", tmp_path / "proc_cgroup") == 2**29
    )
    write(tmp_path / "proc_cgroup", "0::/\n")
    assert cgroup_room(tmp_path / "cg", tmp_path / "proc_cgroup") is None
    assert (
        available_memory(tmp_path / "meminfo", tmp_path / "cg", tmp_path / "proc_cgroup")
        == 20 * 2**30
    )


def test_parse_budget() -> None:
    assert parse_budget("25%", 4 * 2**30) == 2**30
    assert parse_budget("8GiB", 1) == 8 * 2**30
    assert parse_budget(None, 4 * 2**30) == 2 * 2**30
    with pytest.raises(ValueError, match="percentage"):
        parse_budget("0%", 1)


def test_warming_stays_within_the_budget_in_consumption_order(tmp_path: Path) -> None:
    path = cold_file(tmp_path / "ckpt", 96 * MiB)
    budget, tensor = 16 * MiB, 4 * MiB
    flags = (
        "--memory-budget",
        "16MiB",
        "--chunk-size",
        "4MiB",
        "--method",
        "read",
        "--seek-cost",
        "0",
    )
    peak = [0]
    stop = threading.Event()

    def sample() -> None:
        fd = os.open(path, os.O_RDONLY)
        while not stop.wait(0.005):
            peak[0] = max(peak[0], resident_bytes(fd, 0, 96 * MiB))
        os.close(fd)

    orders: dict[int, list[str]] = {}
    waiting_seen = []

    def rank(r: int, socket: str) -> None:
        names = [f"r{r}t{i}" for i in range(12)]
        spans = [
            TensorSpans(n, str(path), (r * 12 + i) * tensor, tensor, tensor, 1)
            for i, n in enumerate(names)
        ]
        client = Client(socket, read_yourself=False)
        ticket = client.request(spans, rank=r)
        orders[r] = []
        fd = os.open(path, os.O_RDONLY)
        for i, name in enumerate(names):
            assert ticket.wait([name], timeout=60)
            orders[r].append(name)
            time.sleep(0.02)  # the loader reads the tensor, then the kernel may drop it
            os.posix_fadvise(fd, (r * 12 + i) * tensor, tensor, os.POSIX_FADV_DONTNEED)
            ticket.consumed([name])
            waiting_seen.append(client.status()["waiting_for_budget"])
        os.close(fd)
        assert not ticket.failures
        client.close()

    with running_daemon(*flags) as daemon:
        sampler = threading.Thread(target=sample)
        sampler.start()
        ranks = [threading.Thread(target=rank, args=(r, daemon.socket)) for r in range(2)]
        for t in ranks:
            t.start()
        for t in ranks:
            t.join(120)
        stop.set()
        sampler.join()
        status = Client(daemon.socket, read_yourself=False).status()
    assert orders == {r: [f"r{r}t{i}" for i in range(12)] for r in range(2)}
    # At most the budget, plus the first unready tensor of each rank, which always may go.
    assert peak[0] <= budget + 2 * tensor, peak[0]
    assert peak[0] >= 2 * tensor
    assert any(waiting_seen), "the budget never held anything back"
    assert status["budget_bytes"] == budget
    assert status["bytes_read_total"] + status["bytes_verified_total"] >= 96 * MiB


def test_a_client_that_never_reports_is_not_stalled_forever(tmp_path: Path) -> None:
    path = cold_file(tmp_path / "ckpt", 32 * MiB)
    spans = [TensorSpans(f"t{i}", str(path), i * 4 * MiB, 4 * MiB, 4 * MiB, 1) for i in range(8)]
    flags = (
        "--memory-budget",
        "8MiB",
        "--chunk-size",
        "4MiB",
        "--hold-seconds",
        "0.5",
        "--method",
        "read",
    )
    with running_daemon(*flags) as daemon:
        client = Client(daemon.socket, read_yourself=False)
        start = time.monotonic()
        ticket = client.request(spans, rank=0)
        assert ticket.wait(timeout=60)
        elapsed = time.monotonic() - start
        client.close()
    assert ticket.progress.ready == 8
    assert elapsed >= 0.5  # it did wait for holds to expire at least once


def test_hold_keeps_warmed_spans_mapped_until_read(tmp_path: Path) -> None:
    path = cold_file(tmp_path / "ckpt", 16 * MiB)
    spans = [TensorSpans(f"t{i}", str(path), i * 4 * MiB, 4 * MiB, 4 * MiB, 1) for i in range(4)]

    def mapped_bytes(pid: int) -> int:
        total = 0
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            if line.endswith(str(path)):
                start, end = (int(x, 16) for x in line.split()[0].split("-"))
                total += end - start
        return total

    with running_daemon("--hold", "--chunk-size", "4MiB", "--method", "read") as daemon:
        client = Client(daemon.socket, read_yourself=False)
        ticket = client.request(spans, rank=0)
        assert ticket.wait(timeout=30)
        held = mapped_bytes(daemon.process.pid)
        ticket.consumed(["t0", "t1"])
        deadline = time.monotonic() + 10
        while mapped_bytes(daemon.process.pid) > 8 * MiB and time.monotonic() < deadline:
            time.sleep(0.02)
        after_two = mapped_bytes(daemon.process.pid)
        client.close()
    assert held == 16 * MiB
    assert after_two == 8 * MiB


def test_the_daemon_derives_its_budget_from_the_cgroup(tmp_path: Path) -> None:
    """A fake cgroup filesystem laid out where this process's cgroups say (the daemon
    inherits them): 1 GiB limit, 256 MiB working set, so half of 768 MiB is the budget;
    then 768 MiB of working set, half of 256 MiB."""
    root = tmp_path / "cgroup"

    def working_set(nbytes: int) -> None:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == "":
                directory = root / path.lstrip("/")
                write(directory / "memory.max", f"{2**30}\n")
                write(directory / "memory.current", f"{nbytes}\n")
                write(directory / "memory.stat", "inactive_file 0\n")
            elif "memory" in controllers.split(","):
                directory = root / "memory" / path.lstrip("/")
                write(directory / "memory.limit_in_bytes", f"{2**30}\n")
                write(directory / "memory.usage_in_bytes", f"{nbytes}\n")
                write(directory / "memory.stat", "total_inactive_file 0\n")

    working_set(2**28)
    with running_daemon("--cgroup-root", str(root)) as daemon:
        client = Client(daemon.socket, read_yourself=False)
        assert client.status()["budget_bytes"] == (2**30 - 2**28) // 2
        # The ranks' own memory grows as they load: the budget follows the room left.
        working_set(3 * 2**28)
        deadline = time.monotonic() + 10
        while client.status()["budget_bytes"] != (2**30 - 3 * 2**28) // 2:
            assert time.monotonic() < deadline, "the budget did not follow the cgroup"
            time.sleep(0.2)
    # A fixed size stays what it says.
    with running_daemon("--cgroup-root", str(root), "--memory-budget", "64MiB") as daemon:
        assert Client(daemon.socket, read_yourself=False).status()["budget_bytes"] == 64 * MiB


def test_a_held_cell_the_rank_cannot_read_yet_does_not_stall_it_past_the_budget(
    tmp_path: Path,
) -> None:
    # B joins while A's first cell is being read; that cell holds B's *second* tensor, so
    # B holds it ready before its first tensor. Past the budget, B's first tensor used to
    # be refused ("it holds unread tensors") while first-tensors-first kept everyone else
    # waiting for B: both ranks stood still until the holds expired (20 s here).
    path = cold_file(tmp_path / "f", 8 * MiB)
    flags = ("--method", "read", "--chunk-size", "1MiB", "--workers", "1", "--seek-cost", "0")
    budget = ("--memory-budget", "1MiB", "--hold-seconds", "20", "--throttle", "4MiB")
    with running_daemon(*flags, *budget) as daemon:
        a, b = (
            Client(daemon.socket, read_yourself=False),
            Client(daemon.socket, read_yourself=False),
        )
        rank_a = a.request(
            [
                TensorSpans("a0", str(path), 0, MiB, MiB, 1),
                TensorSpans("a1", str(path), MiB, MiB, MiB, 1),
            ],
            rank=0,
        )
        time.sleep(0.05)  # A's first cell is in flight (a 1 MiB read takes 0.25 s here)
        rank_b = b.request(
            [
                TensorSpans("b0", str(path), 2 * MiB, MiB, MiB, 1),
                TensorSpans("b1", str(path), 0, MiB, MiB, 1),
            ],
            rank=1,
        )
        assert rank_a.wait(["a0"], timeout=10)
        rank_a.consumed(["a0"])
        started = time.monotonic()
        b_first = rank_b.wait(["b0"], timeout=15)
        took = time.monotonic() - started
        a_second = rank_a.wait(["a1"], timeout=15)
        for ticket in (rank_a, rank_b):
            ticket.cancel()
        a.close()
        b.close()
    assert b_first, "B's first tensor waited for the holds to expire"
    assert a_second
    assert took < 15
