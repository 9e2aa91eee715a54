"""The closer's lanes, with closes that really block: files on a FUSE mount whose server
never answers their FLUSH (``slowfs`` with ``hang_flush``) until it is unmounted."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from spanwarm.daemon.closer import Closer
from spanwarm.testing.slowfs import SlowFS, fuse_available, mount

pytestmark = pytest.mark.skipif(
    fuse_available() is not None, reason=f"needs the emulated mount: {fuse_available()}"
)


def wait_until(predicate: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def stop_answering(fs: SlowFS) -> None:
    """Stop the server (its hung FLUSHes then fail, and the closes return) before the
    mount is torn down: fusermount, forked meanwhile, would inherit the descriptors still
    queued and hang closing them."""
    os.kill(fs.pid, signal.SIGTERM)


def hung_files(tmp_path: Path, n: int) -> tuple[Path, list[str]]:
    source = tmp_path / "src"
    source.mkdir()
    names = [f"hung-{i}.bin" for i in range(n)]
    for name in names:
        (source / name).write_bytes(b"x" * 4096)
    return source, names


def test_a_uid_opens_at_most_its_lanes_and_its_closes_count_until_done(tmp_path: Path) -> None:
    source, names = hung_files(tmp_path, 6)
    closer = Closer(max_lanes=64, max_user_lanes=4)
    with mount(source, tmp_path / "mnt", hang_flush=names) as fs:
        # Opened first: the server serves nothing more once one FLUSH hangs.
        fds = [os.open(fs.path(name), os.O_RDONLY) for name in names]
        for lane, fd in enumerate(fds):  # 4 lanes of its own, then its overflow lane
            closer.close(fd, ("dev", lane), 1000)
        time.sleep(0.2)
        assert closer.pending(1000) == 6
        assert closer.lanes == 5
        # Another uid's close, in a lane of its own, is not held up.
        r, w = os.pipe()
        os.close(w)
        closer.close(r, ("dev", 99), 2000)
        wait_until(lambda: closer.pending(2000) == 0, timeout=5)
        assert closer.pending_except(frozenset({1000})) == 0
        assert closer.pending(1000) == 6
        stop_answering(fs)
        wait_until(lambda: closer.pending(1000) == 0)
        wait_until(lambda: closer.lanes == 0)


def test_past_the_lanes_of_all_a_close_waits_in_the_shared_overflow_lane(tmp_path: Path) -> None:
    source, names = hung_files(tmp_path, 3)
    closer = Closer(max_lanes=2, max_user_lanes=4)
    with mount(source, tmp_path / "mnt", hang_flush=names) as fs:
        fds = [os.open(fs.path(name), os.O_RDONLY) for name in names]
        for uid, fd in enumerate(fds):
            closer.close(fd, ("dev", uid), uid)
        time.sleep(0.2)
        assert closer.lanes == 3  # two lanes and the shared overflow
        assert closer.pending_except(frozenset()) == 3
        stop_answering(fs)
        wait_until(lambda: closer.lanes == 0)
        assert closer.pending_except(frozenset()) == 0
