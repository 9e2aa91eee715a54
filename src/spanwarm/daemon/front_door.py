"""The gRPC socket's front door: who connects, and how many connections each uid holds.

gRPC cannot tell who is on the other end of a Unix socket, and it bounds neither the
connections one caller opens nor how long they sit idle: one member of the socket group
could take every descriptor the daemon has, and root's liveness probe with them. So gRPC
listens on an inner socket, in a directory only the daemon's user can enter, and the
socket callers know is a door in front of it. The door asks the kernel who connected
(``SO_PEERCRED``), closes a connection at once when that uid already holds
``user_connections`` of them or users together hold ``users_connections``
(:mod:`spanwarm.daemon.descriptors`: both follow from RLIMIT_NOFILE), and otherwise joins
it to a connection of its own to the inner socket, byte for byte, with flow control both
ways. Root and the daemon's own user are not counted: their connections come out of the
reserve. What frees a connection gRPC decides: one with no call for ``IDLE_SECONDS``, or
that has not said its HTTP/2 preface within ``HANDSHAKE_SECONDS``, is closed by gRPC (the
options in :data:`GRPC_OPTIONS`), and the door closes its caller's end with it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import shutil
import socket
import stat
import struct
import time
from collections.abc import Callable
from typing import cast

from spanwarm.daemon.accepting import listen_privately, pause_accepting
from spanwarm.daemon.descriptors import user_connections, users_connections
from spanwarm.errors import TooManyConnectionsError

__all__ = ["GRPC_OPTIONS", "FrontDoor", "inner_socket_path", "prepare_inner_directory"]

logger = logging.getLogger("spanwarm.daemon")

IDLE_SECONDS = 60.0  # a channel reconnects by itself when it next has a call
HANDSHAKE_SECONDS = 10.0
GRPC_OPTIONS = [
    ("grpc.max_connection_idle_ms", int(IDLE_SECONDS * 1000)),
    ("grpc.server_handshake_timeout_ms", int(HANDSHAKE_SECONDS * 1000)),
]
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_WARN_EVERY = 10.0  # seconds between two warnings about one uid, or about accept
_INNER_DIRECTORY = ".{}.inner"  # beside the socket, 0700
_INNER_NAME = "grpc"


def inner_socket_path(socket_path: str) -> str:
    """Where gRPC listens, behind the door at ``socket_path``."""
    parent, name = os.path.split(os.path.abspath(socket_path))
    return os.path.join(parent, _INNER_DIRECTORY.format(name), _INNER_NAME)


def prepare_inner_directory(socket_path: str) -> str:
    """Create the inner socket's directory afresh, 0700 (its parent is the socket's, which
    no other user controls: checked before); the inner socket's path."""
    inner = inner_socket_path(socket_path)
    if len(os.fsencode(inner)) > 107:  # sun_path is 108 bytes with its NUL
        raise OSError(f"{inner}: the inner socket's path is longer than 107 bytes")
    directory = os.path.dirname(inner)
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISDIR(os.lstat(directory).st_mode):
            shutil.rmtree(directory)  # a daemon that died left it
        else:
            os.unlink(directory)
    os.mkdir(directory, 0o700)
    os.chmod(directory, 0o700)  # mkdir's mode is masked by the umask
    return inner


class _Half(asyncio.Protocol):
    """One end of a joined pair: what it receives goes out of its partner, reading
    pauses while the partner cannot write, and either end closing (or sending EOF: HTTP/2
    never half-closes) closes both, the partner once it has written what it holds."""

    def __init__(self, on_lost: Callable[[], None] | None = None) -> None:
        self.transport: asyncio.Transport | None = None
        self.partner: _Half | None = None
        self.on_lost = on_lost
        self._early: list[bytes] = []  # received before the partner was joined

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses

    def join(self, partner: _Half) -> None:
        self.partner = partner
        assert partner.transport is not None
        for data in self._early:
            partner.transport.write(data)
        self._early.clear()

    @property
    def _out(self) -> asyncio.Transport | None:
        return None if self.partner is None else self.partner.transport

    def data_received(self, data: bytes) -> None:
        if (out := self._out) is None:
            self._early.append(data)
        else:
            out.write(data)

    def pause_writing(self) -> None:
        if (out := self._out) is not None:
            out.pause_reading()

    def resume_writing(self) -> None:
        if (out := self._out) is not None:
            out.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        if (out := self._out) is not None:
            out.close()
        if self.on_lost is not None:
            on_lost, self.on_lost = self.on_lost, None
            on_lost()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.abort()


class FrontDoor:
    def __init__(
        self,
        path: str,
        inner: str,
        *,
        trusted: frozenset[int],
        refused: Callable[[BaseException], object] | None = None,
    ) -> None:
        self.path = path
        self.inner = inner
        self.trusted = trusted
        self.refused = refused  # counts a refused connection (Status, metrics)
        self.users_max = users_connections()
        self.user_max = user_connections()
        self.connections: collections.Counter[int] = collections.Counter()  # users' only
        self._halves: set[_Half] = set()
        self._joining: set[asyncio.Task[None]] = set()
        self._listener: socket.socket | None = None
        self._warned: dict[int | None, float] = {}

    def start(self) -> None:
        """Bind (mode 0600 from the first instant: the caller opens it to the group
        later) and start accepting."""
        listener = listen_privately(self.path, socket.SOCK_STREAM, socket.SOMAXCONN)
        self._listener = listener
        asyncio.get_running_loop().add_reader(listener.fileno(), self._accept)

    def close(self) -> None:
        """Stop accepting (the socket goes), drop every joined connection, remove the
        inner directory."""
        if self._listener is not None:
            asyncio.get_running_loop().remove_reader(self._listener.fileno())
            self._listener.close()
            self._listener = None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        for task in self._joining:
            task.cancel()
        for half in list(self._halves):
            half.close()
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(os.path.dirname(self.inner))

    @property
    def users_connections(self) -> int:
        return sum(self.connections.values())

    def _accept(self) -> None:
        assert self._listener is not None
        while True:
            try:
                conn, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:  # EMFILE and the like: the caller's channel retries
                self._warn(None, f"cannot accept a connection: {exc}")
                pause_accepting(self._listener, self._accept, lambda: self._listener is not None)
                return
            try:
                _, uid, _ = _UCRED.unpack(
                    conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
                )
            except OSError:
                conn.close()
                continue
            if reason := self._over(uid):
                conn.close()  # before any byte: the caller's channel sees UNAVAILABLE
                self._warn(uid, reason)
                if self.refused is not None:
                    self.refused(TooManyConnectionsError(reason))
                continue
            if uid not in self.trusted:
                self.connections[uid] += 1
            task = asyncio.get_running_loop().create_task(self._join(conn, uid))
            self._joining.add(task)
            task.add_done_callback(self._joining.discard)

    def _over(self, uid: int) -> str:
        if uid in self.trusted:
            return ""
        if self.connections[uid] >= self.user_max:
            return (
                f"uid {uid} holds {self.connections[uid]} connections to {self.path}, as "
                f"many as one uid may ({self.user_max}): closing its new ones"
            )
        if self.users_connections >= self.users_max:
            return (
                f"users hold {self.users_connections} connections to {self.path}, as many "
                f"as the daemon's descriptors leave them ({self.users_max}): closing "
                f"uid {uid}'s new one"
            )
        return ""

    def _warn(self, uid: int | None, message: str) -> None:
        now = time.monotonic()
        if now - self._warned.get(uid, -_WARN_EVERY) >= _WARN_EVERY:  # a flood, one line
            if len(self._warned) > 1024:  # one entry per uid that was ever refused
                self._warned = {u: t for u, t in self._warned.items() if now - t < _WARN_EVERY}
            self._warned[uid] = now
            logger.warning("%s", message)

    def _lost(self, half: _Half, uid: int) -> None:
        self._halves.discard(half)
        if uid not in self.trusted:
            self.connections[uid] -= 1
            if self.connections[uid] <= 0:
                del self.connections[uid]

    async def _join(self, conn: socket.socket, uid: int) -> None:
        """Join the caller's connection to one of ours to gRPC's inner socket. The
        caller's end counts against its uid until it is lost."""
        loop = asyncio.get_running_loop()
        outer: _Half = _Half(on_lost=lambda: self._lost(outer, uid))
        try:
            await loop.connect_accepted_socket(lambda: outer, conn)
        except BaseException:
            conn.close()
            outer.on_lost = None
            self._lost(outer, uid)
            raise
        self._halves.add(outer)
        assert outer.transport is not None
        outer.transport.pause_reading()  # until there is somewhere to put what it sends
        inner = _Half(on_lost=lambda: self._halves.discard(inner))
        try:
            await loop.create_unix_connection(lambda: inner, self.inner)
        except BaseException as exc:
            outer.close()
            if not isinstance(exc, OSError):
                raise
            self._warn(None, f"cannot reach gRPC's socket {self.inner}: {exc}")
            return
        self._halves.add(inner)
        outer.join(inner)
        inner.join(outer)
        if outer.transport.is_closing():  # the caller left while we connected
            inner.close()
        else:
            outer.transport.resume_reading()
