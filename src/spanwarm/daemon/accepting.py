"""The daemon's listening Unix sockets: bound private, and paused when ``accept`` fails.

A socket is bound under umask 0177, so it is 0600 from the first instant (the server
hands it to ``--socket-group`` later). Out of descriptors (EMFILE), a listening socket
stays readable with the connection still queued, so a loop reader on it would run again
at once, and again: the event loop would spin. The reader is taken off for a second
instead; callers retry meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Callable

__all__ = ["PAUSE_S", "listen_privately", "pause_accepting"]

PAUSE_S = 1.0


def listen_privately(path: str, kind: int, backlog: int) -> socket.socket:
    """A non-blocking listening Unix socket of ``kind`` at ``path``, mode 0600 (a stale
    socket there, left by a daemon that died, is replaced: the caller checked)."""
    listener = socket.socket(socket.AF_UNIX, kind | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
    previous = os.umask(0o177)
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        listener.bind(path)
        listener.listen(backlog)
    except BaseException:
        listener.close()
        raise
    finally:
        os.umask(previous)
    return listener


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
