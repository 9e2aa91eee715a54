"""systemd's readiness protocol (sd_notify) in a few lines, without a dependency."""

from __future__ import annotations

import logging
import os
import socket

__all__ = ["notify"]

logger = logging.getLogger("spanwarm.daemon")


def notify(state: str) -> bool:
    """Send ``state`` (e.g. ``READY=1``) to ``$NOTIFY_SOCKET``; False when there is none, or
    nobody listens there any more (a supervisor gone must not stop the daemon from
    serving, nor from shutting down cleanly: draining, keeping what it learned)."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):  # systemd may hand out an abstract address; we only send to it
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.settimeout(1.0)
            sock.connect(address)
            sock.sendall(state.encode())
    except OSError as exc:
        logger.warning("cannot tell %s %r: %s", os.environ.get("NOTIFY_SOCKET"), state, exc)
        return False
    return True
