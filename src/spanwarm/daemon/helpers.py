"""Helper processes for the daemon's CPU-heavy pure steps: decoding and checking a large
request's spans, and indexing them by cell.

Those steps hold the GIL for about a millisecond per thousand spans. In a thread of the
daemon, on a node whose ranks keep the cores busy while they start, the thread is
preempted while it holds the GIL and keeps it until it runs again, and the event loop
(Status, readiness) waits as long: p99 over a second while 64 ranks were admitted on 2
cores. In a process of their own, at niceness +10, the same steps cost the daemon only
the copying of their arrays; the calling thread waits on a pipe, without the GIL.

Each helper is ``python -P -m spanwarm.daemon.helpers``, started by the daemon (never a fork
of it: its grpc threads would be copied mid-step), talking pickle frames over its stdin
and stdout; it runs one call at a time and exits when its stdin closes, so it never
outlives the daemon, however the daemon ends. The functions it runs take and return plain
data (bytes, numpy arrays, strings): no descriptor, no open file, no lock crosses. A
helper that dies fails its call with ``HelperDiedError`` and is replaced.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import logging
import os
import pickle
import queue
import signal
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import IO, Any, ClassVar, TypeVar

from spanwarm.errors import SpanwarmError

__all__ = ["HelperDiedError", "HelperPool"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_FRAME = struct.Struct("<Q")  # each message: its length, then its pickle
# The modules whose functions helpers run, imported before a helper says it is ready.
_STEPS = ("spanwarm.daemon.span_check", "spanwarm.daemon.request")
_READY = b"r"
_PIPE_BYTES = 2**20  # the default /proc/sys/fs/pipe-max-size


class HelperDiedError(SpanwarmError):
    """The helper process running a call died before it answered (a new one takes its
    place: the call may be made again)."""

    grpc_code: ClassVar[str] = "UNAVAILABLE"


def _send(stream: IO[bytes], message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_FRAME.pack(len(data)))
    stream.write(data)
    stream.flush()


def _receive(stream: IO[bytes]) -> Any:
    head = stream.read(_FRAME.size)
    if len(head) < _FRAME.size:
        raise EOFError
    (size,) = _FRAME.unpack(head)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError
    return pickle.loads(data)  # frames from the daemon, or from its own helper


class _Helper:
    """One helper process and its two pipes."""

    def __init__(self, nice: int) -> None:
        self.process = subprocess.Popen(
            # -P: the working directory is not on the path (a root daemon started in a
            # directory others may write would import their spanwarm/ otherwise).
            [sys.executable, "-P", "-m", "spanwarm.daemon.helpers", str(nice)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            close_fds=True,
        )
        self._stdin: IO[bytes] = self.process.stdin  # type: ignore[assignment]
        self._stdout: IO[bytes] = self.process.stdout  # type: ignore[assignment]
        # A call's arrays in one pipe buffer where they fit: each 64 KiB of a default
        # pipe is a read that gives up the GIL and takes it back from the event loop.
        for pipe in (self._stdin, self._stdout):
            with contextlib.suppress(OSError):
                fcntl.fcntl(pipe.fileno(), fcntl.F_SETPIPE_SZ, _PIPE_BYTES)
        self.ready = False

    def wait_ready(self) -> None:
        if not self.ready:
            if self._stdout.read(len(_READY)) != _READY:
                raise HelperDiedError("a helper process exited as it started")
            self.ready = True

    def call(self, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        try:
            self.wait_ready()
            _send(self._stdin, (fn, args))
            ok, value = _receive(self._stdout)
        except (EOFError, OSError, pickle.UnpicklingError):
            self.stop()
            raise HelperDiedError(
                "the daemon's helper process died during the call (killed: out of memory?)"
            ) from None
        if ok:
            return value  # type: ignore[no-any-return]
        raise value

    def stop(self) -> None:
        """Close its pipes and kill it (a thread reaps it)."""
        with contextlib.suppress(OSError):
            self._stdin.close()
        with contextlib.suppress(OSError):
            self._stdout.close()
        with contextlib.suppress(OSError):
            self.process.kill()
        threading.Thread(target=self.process.wait, daemon=True).start()  # reap it


class HelperPool:
    """``workers`` helper processes; a call takes an idle one (waiting while none is)."""

    def __init__(self, workers: int, *, nice: int = 10) -> None:
        self._workers = workers
        self._nice = nice
        self._idle: queue.SimpleQueue[_Helper] = queue.SimpleQueue()
        self._all: list[_Helper] = []
        self._lock = threading.Lock()
        self._closed = False

    def start(self) -> None:
        """Start every helper and wait until each has imported what it runs (a fresh
        interpreter: a few tenths of a second), so that no request pays for it."""
        with self._lock:
            fresh = [self._new() for _ in range(self._workers - len(self._all))]
        for helper in fresh:
            helper.wait_ready()
        for helper in fresh:
            self._idle.put(helper)

    def _new(self) -> _Helper:
        """A new helper (the lock is held)."""
        if self._closed:
            raise RuntimeError("the daemon's helper processes are stopped")
        helper = _Helper(self._nice)
        self._all.append(helper)
        return helper

    def call(self, fn: Callable[..., T], /, *args: Any) -> T:
        """``fn(*args)`` in a helper: its result, or what it raised. Blocks the calling
        thread (without the GIL while the helper works)."""
        with self._lock:
            if len(self._all) < self._workers:  # not started, or one died
                self._idle.put(self._new())
        helper = self._idle.get()
        try:
            return helper.call(fn, args)
        except HelperDiedError:
            with self._lock:
                if helper in self._all:
                    self._all.remove(helper)
            logger.warning("a helper process died (status %s)", helper.process.poll())
            raise
        finally:
            if helper in self._all:
                self._idle.put(helper)

    def pids(self) -> list[int]:
        """The helpers' process ids (for the operator and for tests)."""
        with self._lock:
            return [h.process.pid for h in self._all]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            helpers, self._all = self._all, []
        for helper in helpers:
            helper.stop()


def _serve(nice: int) -> None:
    """A helper's life: import the steps, say ready, then answer calls until stdin ends."""
    with contextlib.suppress(OSError):
        os.nice(nice)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C on the daemon's terminal: its call
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # a stray print must not corrupt the frames
    for name in _STEPS:
        importlib.import_module(name)
    stdout.write(_READY)
    stdout.flush()
    while True:
        try:
            fn, args = _receive(stdin)
        except EOFError:
            return
        try:
            answer: tuple[bool, Any] = (True, fn(*args))
        except Exception as exc:
            answer = (False, exc)
        try:
            _send(stdout, answer)
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            error = RuntimeError(f"{fn.__name__}: an answer pickle cannot carry: {exc!r}")
            _send(stdout, (False, error))
        except BrokenPipeError:
            return


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
