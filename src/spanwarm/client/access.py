"""The client's half of the access channel: prove which files this process may read.

The daemon warms only files its caller opened itself. So the client opens each file
(``O_RDONLY``, with this process's own credentials), passes the descriptors over the
access socket beside the daemon's gRPC socket (``SCM_RIGHTS``, at most 253 per datagram,
opened and closed batch by batch so a checkpoint of thousands of shards never holds
more than 253 at once), and gets back a token its ``Warm`` call carries. Before a byte
is sent, the daemon must be who it should be: the socket's place is checked
(:func:`spanwarm.endpoint.trusted_owners`), and the listening process must run as one of
the users trusted there (``SO_PEERCRED``).
"""

from __future__ import annotations

import errno
import math
import os
import socket
import stat
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

from spanwarm.endpoint import access_socket_path, trusted_owners, unsafe_socket
from spanwarm.rpc.v1 import warmer_pb2

__all__ = ["AccessRefused", "EndpointUnsafe", "Granted", "check_endpoint", "grant"]

SCM_MAX_FD = 253
_UCRED = struct.Struct("3i")


class EndpointUnsafe(Exception):
    """The daemon's socket is somewhere another user controls: nothing is sent."""


class AccessRefused(Exception):
    """The daemon refused the grant; ``code`` is a gRPC status code name."""

    def __init__(self, code: str, reason: str) -> None:
        super().__init__(f"{code}: {reason}")
        self.code = code
        self.reason = reason


@dataclass
class Granted:
    """A token for the files this process could open, and why it could not open the rest."""

    token: str = ""
    expires_s: float = 0.0  # unused for this long, the token lapses
    files: list[int] = field(default_factory=list)  # positions in ``paths``, in grant order
    failures: dict[int, str] = field(default_factory=dict)  # position -> why not
    stream_bytes_per_s: float = 0.0  # the slowest mount's learned one-stream rate (0: unknown)


def _open(path: str) -> int:
    """Our own descriptor for ``path``, for reading; a FIFO or device is refused (opened
    non-blocking, so a FIFO never blocks us)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_endpoint(socket_path: str) -> frozenset[int]:
    """Raise :class:`EndpointUnsafe` unless the daemon's sockets are in a place no other
    user controls, owned by a user we may trust there (root, us, ``$SPANWARM_DAEMON_USER``,
    or a system account root gave the directory to); return those users."""
    directory = os.path.dirname(os.path.abspath(socket_path))
    if not os.path.isdir(directory):
        raise FileNotFoundError(errno.ENOENT, "no daemon is listening", socket_path)
    owners, reason = trusted_owners(directory, delegate=True)
    if reason:
        raise EndpointUnsafe(reason)
    for path in (socket_path, access_socket_path(socket_path)):
        if not os.path.lexists(path):
            raise FileNotFoundError(errno.ENOENT, "no daemon is listening", path)
        if reason := unsafe_socket(path, owners):
            raise EndpointUnsafe(reason)
    return owners


def grant(socket_path: str, paths: Sequence[str], *, timeout: float) -> Granted:
    """Open ``paths`` ourselves, pass the descriptors of those that open to the daemon,
    and return its token for them. Raises OSError (the daemon is unreachable),
    :class:`EndpointUnsafe` or :class:`AccessRefused`."""
    owners = check_endpoint(socket_path)
    granted = Granted()
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as conn:
        conn.settimeout(timeout)
        conn.connect(access_socket_path(socket_path))
        _, uid, _ = _UCRED.unpack(
            conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
        )
        if uid not in owners:
            raise EndpointUnsafe(f"{access_socket_path(socket_path)} is served by uid {uid}")
        position = 0
        while True:
            fds: list[int] = []
            try:
                while len(fds) < SCM_MAX_FD and position < len(paths):
                    try:
                        fds.append(_open(paths[position]))
                        granted.files.append(position)
                    except OSError as exc:
                        granted.failures[position] = (
                            f"{paths[position]}: cannot open it: {exc.strerror or exc}"
                        )
                    position += 1
                last = position == len(paths)
                header = warmer_pb2.GrantRequest(descriptors=len(fds), last=last)
                ancillary = (
                    [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))]
                    if fds
                    else []
                )
                if fds or last:  # an empty datagram would read as hanging up
                    conn.sendmsg([header.SerializeToString()], ancillary)
            finally:
                for fd in fds:
                    os.close(fd)
            if last:
                break
        data = conn.recv(4096)
    if not data:
        raise ConnectionError("the daemon closed the access channel without answering")
    reply = warmer_pb2.GrantReply.FromString(data)
    if not reply.token:
        raise AccessRefused(reply.code or "UNKNOWN", reply.reason)
    granted.token, granted.expires_s = reply.token, reply.expires_s
    rate = reply.stream_bytes_per_s
    granted.stream_bytes_per_s = rate if math.isfinite(rate) and 0 < rate <= 1e12 else 0.0
    return granted
