"""The access channel: callers prove which files they may read by handing them over open.

gRPC cannot tell who is on the other end of a Unix socket, so next to the gRPC socket the
daemon listens on a ``SOCK_SEQPACKET`` socket (``<socket>.access``, same owner and mode).
A caller opens its files itself, with its own credentials, and sends the descriptors
(``SCM_RIGHTS``); the kernel tells us its pid, uid and gid (``SO_PEERCRED``). Each
descriptor must be open for reading (an ``O_PATH`` one proves nothing) on a regular file
inside the allowed roots (checked on the kernel's name for it); the file table keeps it
and shares it by identity. The caller gets a token (:mod:`spanwarm.daemon.grants`) that
its ``Warm`` call carries. The protocol is in protos/spanwarm/v1/warmer.proto (Grant).

What a caller cannot make us do: read a file it could not open, follow a path it
controls, or hold a connection, a thread or a descriptor for long. A grant must arrive
within ``GRANT_SECONDS``; a uid may have ``user_connections()`` connections open (its idle
ones cannot lock others out) and ``--user-max-files`` file references in grants and
requests; descriptors are checked as each datagram arrives (one sent a thousand times is
held once), in threads of the caller's own uid (a user's hung FUSE mount stalls only
that user's grants); anything not passed on to a grant is closed.
"""

from __future__ import annotations

import array
import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import os
import socket
import struct
import time
from collections.abc import Callable

from google.protobuf.message import DecodeError

from spanwarm.daemon.accepting import listen_privately, pause_accepting
from spanwarm.daemon.closer import Closer
from spanwarm.daemon.descriptors import (
    RESERVE_SHARE,
    user_connections,
    users_connections,
    users_files,
)
from spanwarm.daemon.files import Adopted, FileTable
from spanwarm.daemon.grants import Grants, Peer
from spanwarm.daemon.threads import DaemonThreadPool
from spanwarm.errors import InvalidRequestError, RequestTooLargeError, SpanwarmError
from spanwarm.rpc.v1 import warmer_pb2

__all__ = ["GRANT_SECONDS", "SCM_MAX_FD", "AccessServer"]

logger = logging.getLogger("spanwarm.daemon")

SCM_MAX_FD = 253  # the kernel's limit on descriptors in one message
GRANT_SECONDS = 10.0  # a connection has this long to send its descriptors and be answered
_DATAGRAM = 64  # a GrantRequest is a few bytes; anything longer is refused as cut short
_MAX_CONNECTIONS = 1024  # open at once, for everyone; more are closed at once
_WARN_EVERY = 10.0  # seconds between two warnings that connections cannot be accepted
_CHECK_THREADS = 2  # per uid
_IDLE_POOLS = 32  # users whose check threads are kept while they have no connection
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class _Closed(Exception):
    """The caller hung up before finishing its grant: nobody to answer."""


class AccessServer:
    def __init__(
        self,
        path: str,
        files: FileTable,
        grants: Grants,
        *,
        max_files: int,
        user_max_files: int,
        trusted: frozenset[int],
        closer: Closer,
        stream_rate: Callable[[int], float] | None = None,
        refused: Callable[[BaseException], object] | None = None,
    ) -> None:
        self.path = path
        self.refused = refused  # counts a refused grant by its cause
        self.stream_rate = stream_rate  # st_dev -> learned bytes/s of one stream (0: unknown)
        self.files = files
        self.grants = grants
        self.closer = closer  # descriptors still closing count against their uid
        self.max_files = max_files
        # Descriptors are the daemon's scarcest resource: every file of a live grant or
        # request stays open. Users' files share what the limit leaves after the reserve
        # and the connections (spanwarm.daemon.descriptors), and one uid gets at most
        # half of that, whatever --user-max-files says.
        self.users_max_files = users_files()
        self.user_max_files = min(user_max_files, max(1, self.users_max_files // 2))
        self.trusted = trusted
        # Open at once for users together, and for one uid (root and the daemon's user:
        # no limit but _MAX_CONNECTIONS): spanwarm.daemon.descriptors.
        self.users_max_connections = users_connections()
        self.user_max_connections = user_connections()
        self._listener: socket.socket | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._pools: dict[int, DaemonThreadPool] = {}
        self._connections: collections.Counter[int] = collections.Counter()
        self._receiving: collections.Counter[int] = collections.Counter()  # descriptors
        self._warned = -float("inf")

    def start(self) -> None:
        """Bind (mode 0600 from the first instant: the caller sets it for the group
        later, as for the gRPC socket) and start accepting."""
        listener = listen_privately(self.path, socket.SOCK_SEQPACKET, 128)
        self._listener = listener
        asyncio.get_running_loop().add_reader(listener.fileno(), self._accept)

    async def close(self) -> None:
        if self._listener is not None:
            asyncio.get_running_loop().remove_reader(self._listener.fileno())
            self._listener.close()
            self._listener = None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks)
        for pool in self._pools.values():
            pool.shutdown(wait=False, cancel_futures=True)

    def _accept(self) -> None:
        assert self._listener is not None
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:  # EMFILE and the like: the caller times out and retries
                now = time.monotonic()
                if now - self._warned > _WARN_EVERY:  # a flood must not flood the log too
                    self._warned = now
                    logger.warning("access channel: cannot accept: %s", exc)
                pause_accepting(self._listener, self._accept, lambda: self._listener is not None)
                return
            try:
                peer = Peer(
                    *_UCRED.unpack(
                        conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
                    )
                )
            except OSError:
                conn.close()
                continue
            if len(self._tasks) >= _MAX_CONNECTIONS or (
                peer.uid not in self.trusted
                and (
                    self._connections[peer.uid] >= self.user_max_connections
                    or self._users_connections() >= self.users_max_connections
                )
            ):
                conn.close()  # one user's idle connections must not lock the others out
                continue
            conn.setblocking(False)
            self._connections[peer.uid] += 1
            task = loop.create_task(self._serve(conn, peer))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _serve(self, conn: socket.socket, peer: Peer) -> None:
        files: list[Adopted] = []  # adopted so far: given back unless a grant takes them
        received = [0]  # descriptors this connection counts in self._receiving
        try:
            try:
                async with asyncio.timeout(GRANT_SECONDS):
                    await self._receive(conn, peer, files, received)
                rate = self._slowest_rate(files)
                grant = self.grants.issue(peer, files)
                files = []
                reply = warmer_pb2.GrantReply(
                    token=grant.token, expires_s=self.grants.ttl, stream_bytes_per_s=rate
                )
            except SpanwarmError as exc:
                logger.info("access channel: refused uid %d (pid %d): %s", peer.uid, peer.pid, exc)
                self._count(exc)
                reply = warmer_pb2.GrantReply(code=exc.grpc_code, reason=str(exc)[:1000])
            except TimeoutError as exc:
                self._count(exc)
                reply = warmer_pb2.GrantReply(
                    code="DEADLINE_EXCEEDED",
                    reason=f"the grant was not complete and checked within {GRANT_SECONDS:.0f} s",
                )
            with contextlib.suppress(OSError):
                conn.send(reply.SerializeToString())
        except _Closed:
            pass
        except Exception:
            logger.exception("access channel: unexpected error")
        finally:
            for file, _ in files:
                self.files.release(file)
            conn.close()
            self._receiving[peer.uid] -= received[0]
            if self._receiving[peer.uid] <= 0:
                del self._receiving[peer.uid]
            self._connections[peer.uid] -= 1
            if not self._connections[peer.uid]:
                del self._connections[peer.uid]
                self._retire_idle_pools()

    def _users_connections(self) -> int:
        return sum(n for uid, n in self._connections.items() if uid not in self.trusted)

    def _count(self, exc: BaseException) -> None:
        if self.refused is not None:
            self.refused(exc)

    def _slowest_rate(self, files: list[Adopted]) -> float:
        """The learned one-stream rate of the slowest mount among ``files`` (0.0 while one
        is unknown, or without a learner)."""
        if self.stream_rate is None or not files:
            return 0.0
        devices = {file.identity.device for file, _ in files}
        return min(self.stream_rate(device) for device in devices)

    def _retire_idle_pools(self) -> None:
        """Keep the check threads of recent users (starting two threads per grant costs a
        sequential client a millisecond), but not of more than ``_IDLE_POOLS`` users."""
        idle = [uid for uid in self._pools if uid not in self._connections]
        for uid in idle[: max(0, len(idle) - _IDLE_POOLS)]:  # oldest first (insertion order)
            self._pools.pop(uid).shutdown(wait=False)

    async def _receive(
        self, conn: socket.socket, peer: Peer, files: list[Adopted], received: list[int]
    ) -> None:
        """Read datagrams until the one marked last, checking and keeping each one's
        descriptors as it arrives (so a descriptor sent a thousand times is held once).
        ``received[0]`` counts them, as the uid's share of ``_receiving``."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                data, ancillary, flags, _ = conn.recvmsg(
                    _DATAGRAM, socket.CMSG_SPACE(SCM_MAX_FD * 4)
                )
            except BlockingIOError:
                await _readable(loop, conn)
                continue
            got = _descriptors(ancillary)
            try:
                if not data and not got:
                    raise _Closed
                if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                    raise InvalidRequestError(
                        "a grant datagram was cut short (more than 64 bytes, more than "
                        f"{SCM_MAX_FD} descriptors, or the daemon is out of descriptors)"
                    )
                try:
                    message = warmer_pb2.GrantRequest.FromString(data)
                except DecodeError as exc:
                    raise InvalidRequestError(f"not a valid GrantRequest: {exc}") from None
                if message.descriptors != len(got):
                    raise InvalidRequestError(
                        f"a datagram says it carries {message.descriptors} descriptors and "
                        f"carries {len(got)}"
                    )
                if received[0] + len(got) > self.max_files:
                    raise RequestTooLargeError(
                        f"more than {self.max_files} descriptors in one grant (--max-files)"
                    )
                closing = self.closer.pending(peer.uid)
                held = self.grants.references(peer.uid) + self._receiving[peer.uid] + closing
                if peer.uid not in self.trusted and held + len(got) > self.user_max_files:
                    raise RequestTooLargeError(
                        f"uid {peer.uid} would hold more than {self.user_max_files} files "
                        "in grants and requests (--user-max-files, at most half of the "
                        "descriptors the daemon leaves to users)"
                        + (
                            f"; {closing} of its files are still closing, their file "
                            "system not answering"
                            if closing
                            else ""
                        )
                    )
                users = (
                    self.grants.references_except(self.trusted)
                    + sum(n for uid, n in self._receiving.items() if uid not in self.trusted)
                    + self.closer.pending_except(self.trusted)
                )
                if peer.uid not in self.trusted and users + len(got) > self.users_max_files:
                    raise RequestTooLargeError(
                        f"the daemon's descriptors for users are in use: {users} of "
                        f"{self.users_max_files} (its RLIMIT_NOFILE less {RESERVE_SHARE:.0%} "
                        "kept for root and the daemon's user, less users' connections); try "
                        "again when loads end"
                    )
            except BaseException:
                for fd in got:
                    self.files.close_fd(fd, peer.uid)
                raise
            self._receiving[peer.uid] += len(got)  # until the connection ends (_serve)
            received[0] += len(got)
            files += await self._adopt(peer, got, first=received[0] - len(got))
            if message.last:
                return

    async def _adopt(self, peer: Peer, fds: list[int], *, first: int) -> list[Adopted]:
        """Check and keep the descriptors, in a thread of the caller's uid. They pass to
        the file table (which closes any it refuses); if we stop waiting, what the thread
        took is given back when it finishes."""
        if not fds:
            return []
        pool = self._pools.get(peer.uid)
        if pool is None:
            pool = self._pools[peer.uid] = DaemonThreadPool(
                _CHECK_THREADS, f"spanwarm-access-{peer.uid}", nice=10
            )
        job = pool.submit(self._adopt_blocking, fds, first, peer.uid)
        try:
            return await asyncio.wrap_future(job)
        except asyncio.CancelledError:
            if job.cancel():  # never started: the descriptors are still ours to close
                for fd in fds:
                    self.files.close_fd(fd, peer.uid)
            else:
                job.add_done_callback(self._give_back)
            raise

    def _give_back(self, job: concurrent.futures.Future[list[Adopted]]) -> None:
        if not job.cancelled() and job.exception() is None:
            for file, _ in job.result():
                self.files.release(file)

    def _adopt_blocking(self, fds: list[int], first: int, uid: int) -> list[Adopted]:
        files: list[Adopted] = []
        for position, fd in enumerate(fds):
            try:
                files.append(self.files.adopt(fd, f"descriptor {first + position}", uid=uid))
            except BaseException:
                for rest in fds[position + 1 :]:
                    self.files.close_fd(rest, uid)
                for file, _ in files:
                    self.files.release(file)
                raise
        return files


async def _readable(loop: asyncio.AbstractEventLoop, conn: socket.socket) -> None:
    ready = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(conn.fileno(), wake)
    try:
        await ready
    finally:
        loop.remove_reader(conn.fileno())


def _descriptors(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    fds = array.array("i")
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    return list(fds)
