"""The daemon's descriptors, shared out so that no user can take what root needs.

Every file a live grant or request names stays open, every connection to the gRPC
socket holds three (the caller's end at the front door, the door's end of the inner
socket, and gRPC's), and one to the access channel holds one. A share of RLIMIT_NOFILE,
at least ``RESERVE_MIN``, is kept for root and the daemon's own user: the liveness probe,
root's ``spanwarm status``, their loads, the logs and the warm engine's streams. Users
share the rest, one eighth for connections (as many to the access channel as to gRPC at
most: four descriptors a pair) and the remainder for files; one uid gets at most half of
either.

With 1,024 descriptors: 256 kept, 768 for users, 96 of them for 24 connections of each
kind (12 per uid) and 672 for files (336 per uid). With 524,288 (systemd's default hard
limit, which ``spanwarm serve`` raises its soft limit to): 131,072 kept, 12,288
connections of each kind (64 per uid, ``USER_CONNECTIONS_MAX``), 344,064 files.
"""

from __future__ import annotations

import resource

__all__ = [
    "DESCRIPTORS_PER_CONNECTION",
    "RESERVE_MIN",
    "RESERVE_SHARE",
    "USER_CONNECTIONS_MAX",
    "descriptor_limit",
    "reserved",
    "user_connections",
    "users_connections",
    "users_files",
]

RESERVE_SHARE = 0.25
RESERVE_MIN = 256
CONNECTIONS_SHARE = 1 / 8  # of what users get
DESCRIPTORS_PER_CONNECTION = 4  # three for one to gRPC, one for one to the access channel
# A node's ranks (8 GPUs, a few jobs of one user) need tens of connections; each costs
# the daemon about 20 KiB in gRPC and the door besides its descriptors.
USER_CONNECTIONS_MAX = 64


def descriptor_limit() -> int:
    """The daemon's RLIMIT_NOFILE (soft: what ``open`` and ``accept`` are held to)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 1 << 20 if soft == resource.RLIM_INFINITY else soft


def reserved(limit: int) -> int:
    """Descriptors users never take: for root and the daemon's own user."""
    return min(limit - 1, max(RESERVE_MIN, int(limit * RESERVE_SHARE)))


def _users(limit: int) -> int:
    return max(1, limit - reserved(limit))


def users_connections(limit: int | None = None) -> int:
    """How many connections to gRPC, and to the access channel, all users together may
    have open."""
    share = int(_users(limit or descriptor_limit()) * CONNECTIONS_SHARE)
    return max(2, share // DESCRIPTORS_PER_CONNECTION)


def user_connections(limit: int | None = None) -> int:
    """How many connections to gRPC, and to the access channel, one uid may have open."""
    return max(1, min(USER_CONNECTIONS_MAX, users_connections(limit) // 2))


def users_files(limit: int | None = None) -> int:
    """How many files all users' grants and requests together may hold open."""
    users = _users(limit or descriptor_limit())
    return max(1, users - int(users * CONNECTIONS_SHARE))
