"""Who a call to the Warmer service comes from, and what it may touch.

A call proves who it comes from with a token (:mod:`spanwarm.daemon.grants`): a ``Warm``
spends a grant and warms exactly the files it proved, ``Consumed`` needs the token of its
request's own ``Warm``, and ``Status`` shows a caller other than root or the daemon's
user its own ranks only. Without a token, only an owner-only socket (mode 0600, no
socket group: nobody but the daemon's user and root can connect) is served, as that
user; elsewhere such a call is UNAUTHENTICATED.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from dataclasses import dataclass

from spanwarm.daemon.grants import Grant, Grants, same_token
from spanwarm.errors import UnauthenticatedError

__all__ = ["Authentication", "StatusCaller"]


@dataclass(frozen=True, slots=True)
class StatusCaller:
    """Who a ``Status`` call comes from: ``uid`` (None: no token, the daemon's own user
    on an owner-only socket, or nobody), and whether it sees everything: every rank,
    what each mount taught the daemon and who was refused what."""

    uid: int | None
    sees_everything: bool


class Authentication:
    """The checks on a call's token, for a daemon listening on ``socket``."""

    def __init__(
        self,
        grants: Grants,
        *,
        socket: str,
        socket_group: str | None,
        trusted: Collection[int],
    ) -> None:
        self.grants = grants
        self.socket = socket
        self.socket_group = socket_group
        self.trusted = trusted  # root and the daemon's user: they see everything

    def owner_only(self) -> bool:
        """True when nobody but the daemon's own user (and root) can connect: no socket
        group, and the socket's mode gives the group and others nothing (checked on
        every call: an operator's chmod counts at once)."""
        if self.socket_group:
            return False
        try:
            return not os.stat(self.socket).st_mode & 0o077
        except OSError:
            return False

    def unproven(self, what: str) -> UnauthenticatedError:
        """The refusal of a call that carries no token on a shared socket."""
        return UnauthenticatedError(
            f"{what} needs a token: this socket is shared, so callers prove which files they "
            f"may read by passing their descriptors on {self.socket}.access "
            "(spanwarm.client does this)"
        )

    def warm_grant(self, token: str) -> Grant | None:
        """The grant a ``Warm`` call's ``token`` spends (its request then answers to it);
        None for a call without a token on an owner-only socket, whose paths are opened
        by name. Raises :class:`UnauthenticatedError` for any other call."""
        if token:
            return self.grants.spend(token)
        if not self.owner_only():
            raise self.unproven("Warm")
        return None

    def may_consume(self, request_token: str, token: str) -> bool:
        """Whether a ``Consumed`` call carrying ``token`` may report on a request whose
        ``Warm`` spent ``request_token``: the same token, or, for a request admitted by
        name (no token), a call without one on an owner-only socket."""
        if request_token:
            return same_token(request_token, token)
        return not token and self.owner_only()

    def status_caller(self, token: str) -> StatusCaller:
        """Who a ``Status`` call carrying ``token`` comes from. An unknown or lapsed token
        raises :class:`UnauthenticatedError`; no token sees everything on an owner-only
        socket and node totals elsewhere."""
        if not token:
            return StatusCaller(None, self.owner_only())
        uid = self.grants.uid_of(token)
        if uid is None:
            raise UnauthenticatedError(
                "Status: no live token like this one (unknown, or lapsed): ask the "
                "access channel for a new one, or call without a token for node totals"
            )
        return StatusCaller(uid, uid in self.trusted)
