"""``enable()``: every ``dcp.load`` in the process reads through :class:`PrefetchReader`.

``dcp.load``, the deprecated ``dcp.load_state_dict`` and ``_load_state_dict_from_keys``
all hand their reader (the explicit ``storage_reader=`` or the one inferred from
``checkpoint_id=``) to ``state_dict_loader._load_state_dict``, looked up in that module
at call time. Wrapping that one function catches every load however ``load`` was
imported (``dcp.load``, ``from torch.distributed.checkpoint import load``) and leaves
saving alone. A session can also be scoped to one thread (:func:`scoped`): the
transformers integration prefetches its distributed-checkpoint loads that way without
enabling anything process-wide.
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from spanwarm.client.client import Client
from spanwarm.integrations.dcp.reader import KEEP, PrefetchReader

__all__ = ["Prefetch", "disable", "enable", "prefetch", "scoped"]

logger = logging.getLogger("spanwarm.dcp")


class Prefetch:
    """An installed session: ``readers`` lists the readers of the last ``KEEP`` loads it
    wrapped."""

    def __init__(self, client: Client | None, job: str | None, wait_timeout: float | None) -> None:
        self.client = client or Client()
        self.job = job
        self.wait_timeout = wait_timeout
        self.readers: list[PrefetchReader] = []
        self._lock = threading.Lock()

    def wrap(self, reader: Any) -> Any:
        if isinstance(reader, PrefetchReader):
            return reader  # the caller wrapped it already
        wrapped = PrefetchReader(
            reader, client=self.client, job=self.job, wait_timeout=self.wait_timeout
        )
        with self._lock:
            self.readers = [*self.readers[-(KEEP - 1) :], wrapped]
        return wrapped


_LOAD = "_load_state_dict"  # in torch.distributed.checkpoint.state_dict_loader
_installed: Prefetch | None = None
_scoped = threading.local()
_lock = threading.Lock()
_original: Any = None  # torch's _load_state_dict while hooked
_scoped_count = 0  # scoped sessions open in any thread


def _active() -> Prefetch | None:
    session: Prefetch | None = getattr(_scoped, "session", None)
    return session or _installed


def _hook() -> None:
    """Wrap ``_load_state_dict`` once; it consults the active session on every load."""
    global _original
    if _original is not None:
        return
    from torch.distributed.checkpoint import state_dict_loader

    original = getattr(state_dict_loader, _LOAD)
    signature = inspect.signature(original)

    def load_state_dict(*args: Any, **kwargs: Any) -> Any:
        session = _active()
        if session is not None:
            try:
                bound = signature.bind(*args, **kwargs)
                bound.arguments["storage_reader"] = session.wrap(bound.arguments["storage_reader"])
                args, kwargs = bound.args, bound.kwargs
            except Exception as exc:  # never fail a load over a prefetch
                logger.warning("spanwarm: cannot wrap this load's reader (%s); no prefetch", exc)
        return original(*args, **kwargs)

    _original = original
    setattr(state_dict_loader, _LOAD, load_state_dict)


def _unhook() -> None:
    global _original
    if _original is None or _installed is not None or _scoped_count:
        return
    from torch.distributed.checkpoint import state_dict_loader

    setattr(state_dict_loader, _LOAD, _original)
    _original = None


def enable(
    client: Client | None = None, *, job: str | None = None, wait_timeout: float | None = 300.0
) -> Prefetch:
    """Make every ``dcp.load`` in this process prefetch through the node's daemon; returns
    the installed :class:`Prefetch`. When already enabled, the installed one is returned
    unchanged: :func:`disable` first to change its client or settings."""
    global _installed
    with _lock:
        if _installed is None:
            _hook()
            _installed = Prefetch(client, job, wait_timeout)
        return _installed


def disable() -> None:
    """Undo :func:`enable` (torch's function is put back once no scoped session is left)."""
    global _installed
    with _lock:
        _installed = None
        _unhook()


@contextmanager
def prefetch(
    client: Client | None = None, *, job: str | None = None, wait_timeout: float | None = 300.0
) -> Iterator[Prefetch]:
    """:func:`enable` for the ``with`` block only."""
    with _lock:
        installed_before = _installed is not None
    session = enable(client, job=job, wait_timeout=wait_timeout)
    try:
        yield session
    finally:
        if not installed_before:
            disable()


@contextmanager
def scoped(session: Prefetch) -> Iterator[Prefetch]:
    """Loads in this thread use ``session`` while the block runs (others are unaffected)."""
    global _scoped_count
    with _lock:
        _hook()
        _scoped_count += 1
    previous = getattr(_scoped, "session", None)
    _scoped.session = session
    try:
        yield session
    finally:
        _scoped.session = previous
        with _lock:
            _scoped_count -= 1
            _unhook()
