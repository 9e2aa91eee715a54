"""The daemon's settings: one frozen dataclass, the single source of every knob."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from spanwarm.costmodel import DEFAULT_SEEK_COST
from spanwarm.endpoint import default_socket_path

__all__ = ["DaemonConfig"]


@dataclass(frozen=True)
class DaemonConfig:
    socket: str = field(default_factory=default_socket_path)
    """Unix socket path the daemon serves on (never an abstract socket)."""
    socket_group: str | None = None
    """Group allowed to connect (socket mode 0660); otherwise only the daemon's user (0600)."""
    listen: str | None = None
    """Optional TCP address, loopback only, e.g. 127.0.0.1:7070."""
    allow: tuple[str, ...] = ()
    """Roots whose files may be warmed (resolved, symlinks included). Empty: any file."""
    workers: int = 8
    """Warm operations in flight at once (threads)."""
    chunk_bytes: int = 8 * 2**20
    """Largest single warm operation: the device read-ahead window."""
    method: str | None = None
    """populate, read or hint; None picks populate where the kernel has it, else read."""
    seek_cost: int = DEFAULT_SEEK_COST
    """Price of one seek in bytes (the cost model's S)."""
    max_spans: int = 4_000_000
    """Most spans one Warm request may carry."""
    max_files: int = 100_000
    """Most files one Warm request may name."""
    drain_seconds: float = 10.0
    """On SIGTERM, how long open streams may take to finish before the daemon stops."""
    throttle_bytes_per_s: float | None = None
    """Cap on the warm rate (for tests and demos that need to watch readiness unfold)."""

    def __post_init__(self) -> None:
        if not self.socket or self.socket.startswith(("@", "unix-abstract:")):
            raise ValueError(
                f"socket: {self.socket!r} must be a filesystem path (no abstract sockets)"
            )
        if self.workers < 1:
            raise ValueError(f"workers: must be >= 1, got {self.workers}")
        page = os.sysconf("SC_PAGE_SIZE")
        if self.chunk_bytes < page or self.chunk_bytes % page:
            raise ValueError(
                f"chunk_bytes: must be a positive multiple of {page}, got {self.chunk_bytes}"
            )
        if self.method not in (None, "populate", "read", "hint"):
            raise ValueError(f"method: must be populate, read or hint, got {self.method!r}")
        if self.seek_cost < 0:
            raise ValueError(f"seek_cost: must be >= 0, got {self.seek_cost}")
        if self.max_spans < 1 or self.max_files < 1:
            raise ValueError("max_spans and max_files must be >= 1")
        if self.drain_seconds < 0:
            raise ValueError(f"drain_seconds: must be >= 0, got {self.drain_seconds}")
        if self.throttle_bytes_per_s is not None and self.throttle_bytes_per_s <= 0:
            raise ValueError("throttle_bytes_per_s: must be > 0")
        if self.listen is not None:
            host = self.listen.rsplit(":", 1)[0].strip("[]")
            if host not in ("127.0.0.1", "::1", "localhost"):
                raise ValueError(f"listen: {self.listen!r} must be a loopback address")
        if os.geteuid() == 0 and self.socket_group and not self.allow:
            raise ValueError(
                "socket_group: as root, opening the socket to a group needs --allow roots"
            )
