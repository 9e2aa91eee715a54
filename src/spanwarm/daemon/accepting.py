"""Listening sockets that stop accepting for a while when ``accept`` fails.

Out of descriptors (EMFILE), a listening socket stays readable with the connection still
queued, so a loop reader on it would run again at once, and again: the event loop would
spin. The reader is taken off for a second instead; callers retry meanwhile.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

__all__ = ["PAUSE_S", "pause_accepting"]

PAUSE_S = 1.0


def pause_accepting(
    listener: socket.socket, accept: Callable[[], None], still_listening: Callable[[], bool]
) -> None:
    """Take ``accept`` off ``listener`` for ``PAUSE_S``, then put it back unless
    ``still_listening()`` says the listener has been closed meanwhile."""
    loop = asyncio.get_running_loop()
    fd = listener.fileno()
    loop.remove_reader(fd)

    def resume() -> None:
        if still_listening():
            loop.add_reader(fd, accept)

    loop.call_later(PAUSE_S, resume)
