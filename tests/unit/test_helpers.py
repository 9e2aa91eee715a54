"""The daemon's helper processes: real processes, real pickles, real deaths."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from spanwarm.checkpoint.spans import SpanTable
from spanwarm.daemon.config import DaemonConfig
from spanwarm.daemon.helpers import HelperDiedError, HelperPool
from spanwarm.daemon.request import index_cells
from spanwarm.daemon.span_check import decode_and_check
from spanwarm.errors import InvalidRequestError, RequestTooLargeError
from spanwarm.rpc.v1 import warmer_pb2


def _gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        status = Path(f"/proc/{pid}/stat").read_text().split()[2]
        if status == "Z":  # exited, not yet reaped by its parent
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def pool() -> Iterator[HelperPool]:
    helpers = HelperPool(2)
    helpers.start()
    yield helpers
    helpers.close()


def _request(n: int) -> bytes:
    request = warmer_pb2.WarmRequest(job="j", rank=3, files=["/a", "/b"], groups=["g0", "g1"])
    request.file_index.extend([i % 2 for i in range(n)])
    request.offset.extend([4096 * i for i in range(n)])
    request.length.extend([100] * n)
    request.stride.extend([0] * n)
    request.count.extend([1] * n)
    request.group_index.extend([i % 2 for i in range(n)])
    data: bytes = request.SerializeToString()
    return data


def test_the_steps_give_in_a_helper_what_they_give_here(pool: HelperPool) -> None:
    config = DaemonConfig(socket="/tmp/unused.sock")
    data = _request(5000)
    here, there = decode_and_check(data, config), pool.call(decode_and_check, data, config)
    assert (there.job, there.rank, there.paths, there.groups) == (
        "j",
        3,
        ["/a", "/b"],
        ["g0", "g1"],
    )
    for column in ("file_index", "group_index", "offset", "length", "stride", "count", "end"):
        np.testing.assert_array_equal(getattr(there, column), getattr(here, column))

    table = SpanTable(here.offset, here.length, here.stride, here.count)
    args = ([table], [here.group_index], [1 << 30], 2, 1 << 20)
    local, remote = index_cells(*args), pool.call(index_cells, *args)
    assert remote.file_rows == local.file_rows
    np.testing.assert_array_equal(remote.hull_hi, local.hull_hi)
    np.testing.assert_array_equal(remote.queue_order, local.queue_order)


def test_a_refusal_comes_back_as_itself(pool: HelperPool) -> None:
    config = DaemonConfig(socket="/tmp/unused.sock", max_spans=100)
    with pytest.raises(RequestTooLargeError, match="5000 spans exceed the limit of 100"):
        pool.call(decode_and_check, _request(5000), config)
    with pytest.raises(InvalidRequestError, match="not a valid WarmRequest"):
        pool.call(decode_and_check, b"\xff\xff\xff", config)
    assert pool.call(sum, [1, 2, 3]) == 6  # the helper goes on serving


def test_a_killed_helper_fails_its_call_and_is_replaced(pool: HelperPool) -> None:
    before = pool.pids()
    assert len(before) == 2
    for pid in before:
        os.kill(pid, signal.SIGKILL)
    assert all(_gone(pid) for pid in before)
    died = 0
    for _ in range(4):  # each dead helper fails the one call it is given
        try:
            assert pool.call(sum, [1, 2]) == 3
        except HelperDiedError:
            died += 1
    assert died == 2
    after = pool.pids()
    assert len(after) == 2
    assert not set(after) & set(before)
    assert pool.call(sum, [4]) == 4


def test_helpers_exit_with_whoever_started_them(tmp_path: Path) -> None:
    # A process that starts helpers and is then killed outright: no helper outlives it.
    script = (
        "import sys, time\n"
        "from spanwarm.daemon.helpers import HelperPool\n"
        "p = HelperPool(2); p.start()\n"
        "print(*p.pids(), flush=True)\n"
        "time.sleep(60)\n"
    )
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert owner.stdout is not None
    pids = [int(p) for p in owner.stdout.readline().split()]
    assert len(pids) == 2
    assert all(not _gone(pid, 0.2) for pid in pids)
    owner.kill()
    owner.wait()
    assert all(_gone(pid) for pid in pids)


def test_helpers_run_below_the_daemon_s_priority(pool: HelperPool) -> None:
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    for pid in pool.pids():
        assert os.getpriority(os.PRIO_PROCESS, pid) == min(mine + 10, 19)


def test_a_helper_imports_nothing_from_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A daemon started in a directory others may write: their spanwarm/ is not imported.
    planted = tmp_path / "spanwarm" / "daemon"
    planted.mkdir(parents=True)
    marker = tmp_path / "imported"
    for package in (tmp_path / "spanwarm", planted):
        (package / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    (planted / "helpers.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    monkeypatch.chdir(tmp_path)
    helpers = HelperPool(1)
    try:
        helpers.start()
        assert helpers.call(sum, [2, 3]) == 5
    finally:
        helpers.close()
    assert not marker.exists()
