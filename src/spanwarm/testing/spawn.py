"""Start ``spanwarm serve`` as a child process and wait until it is ready.

For the demo, the benchmarks and the tests: readiness comes through the same
sd_notify protocol systemd uses (``READY=1`` on a private datagram socket).
"""

from __future__ import annotations

import functools
import os
import resource
import shutil
import signal
import socket as socketlib
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import IO

from spanwarm.daemon.front_door import inner_socket_path

__all__ = ["ChildDaemon", "spawn_daemon"]


@dataclass
class ChildDaemon:
    socket: str
    process: subprocess.Popen[bytes]
    notify: socketlib.socket
    notifications: list[str] = field(default_factory=list)

    def read_notifications(self, timeout: float = 0.0) -> list[str]:
        """Collect what the daemon sent to NOTIFY_SOCKET (waiting up to ``timeout`` for more)."""
        self.notify.settimeout(max(timeout, 0.001))
        try:
            while True:
                self.notifications.append(self.notify.recv(4096).decode())
                self.notify.settimeout(0.001)
        except (TimeoutError, BlockingIOError):
            pass
        return self.notifications

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Signal the daemon and return its exit status."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self.process.wait(timeout)


def _limit_files(n: int) -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))


@contextmanager
def spawn_daemon(
    *flags: str,
    socket_path: str | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 30.0,
    stderr: IO[bytes] | None = None,
    open_files: int | None = None,
) -> Iterator[ChildDaemon]:
    """Run a daemon on a private socket until the block ends (then SIGTERM it).
    ``open_files``: its RLIMIT_NOFILE, soft and hard (what a unit's LimitNOFILE sets)."""
    directory = tempfile.mkdtemp(prefix="sw-")  # short: socket paths are limited to 108 bytes
    sock = socket_path or os.path.join(directory, "d.sock")
    notify_path = os.path.join(directory, "notify")
    listener = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_DGRAM | socketlib.SOCK_CLOEXEC)
    listener.bind(notify_path)
    # Its own state directory, unless given one: what one daemon learned of the mounts
    # must not leak into the next test's or benchmark arm's.
    state = [] if "--state-dir" in flags else ["--state-dir", os.path.join(directory, "state")]
    process = subprocess.Popen(
        [sys.executable, "-m", "spanwarm", "serve", "--socket", sock, *state, *flags],
        env={**os.environ, "NOTIFY_SOCKET": notify_path, **(env or {})},
        stderr=stderr,
        preexec_fn=None if open_files is None else functools.partial(_limit_files, open_files),
    )
    daemon = ChildDaemon(sock, process, listener)
    try:
        deadline = time.monotonic() + timeout
        while "READY=1" not in daemon.read_notifications(0.1):
            if process.poll() is not None:
                raise RuntimeError(f"the daemon exited with {process.returncode} before READY=1")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the daemon sent no READY=1 within {timeout} s")
        yield daemon
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        listener.close()
        for name in (notify_path, sock, sock + ".access"):
            if os.path.lexists(name) and name.startswith(directory):
                os.unlink(name)
        # A daemon killed leaves its state and gRPC's inner socket behind.
        for left in ("state", os.path.dirname(inner_socket_path(sock))):
            shutil.rmtree(os.path.join(directory, left), ignore_errors=True)
        os.rmdir(directory)
