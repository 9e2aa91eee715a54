"""Tokens: who a call comes from, and which files it proved it may read.

The access channel (:mod:`spanwarm.daemon.access`) learns a caller's uid from the kernel
and its files from descriptors it opened itself, and issues a token for them: 256 random
bits, unguessable. A ``Warm`` call spends a grant's token (once) and the request then
answers to it: ``Consumed`` for that request needs it, and ``Status`` shows the ranks of
the token's uid. An unused grant lapses after ``ttl`` seconds and gives its files back.

All of it runs on the event loop: no locks.
"""

from __future__ import annotations

import collections
import hmac
import secrets
import time
from dataclasses import dataclass

from spanwarm.daemon.files import Adopted, FileTable
from spanwarm.errors import AccessDeniedError, UnauthenticatedError

__all__ = ["Grant", "Grants", "Peer", "same_token"]


@dataclass(frozen=True, slots=True)
class Peer:
    """Who sent the descriptors, as the kernel says (``SO_PEERCRED``)."""

    pid: int
    uid: int
    gid: int


@dataclass(eq=False, slots=True)
class Grant:
    token: str
    peer: Peer
    files: list[Adopted]  # and the caller's kernel name for each
    expires: float

    @property
    def references(self) -> int:
        return len(self.files)


class Grants:
    """Live tokens, and each uid's share of the node's requests.

    A uid's *slots* are its unspent grants plus its live requests; ``max_per_uid`` bounds
    them for every uid but ``exempt`` (root and the daemon's own user).
    """

    def __init__(
        self, files: FileTable, *, ttl: float, max_per_uid: int, exempt: frozenset[int]
    ) -> None:
        self._files = files
        self.ttl = ttl
        self.max_per_uid = max_per_uid
        self.exempt = exempt
        self._unspent: dict[str, Grant] = {}
        self._live: dict[str, int] = {}  # token of a live request -> its uid
        self._slots: dict[int, int] = {}
        self._references: collections.Counter[int] = collections.Counter()  # files, per uid

    def slots(self, uid: int) -> int:
        return self._slots.get(uid, 0)

    def references_except(self, uids: frozenset[int]) -> int:
        """Files the grants and requests of every uid but ``uids`` hold."""
        return sum(n for uid, n in self._references.items() if uid not in uids)

    def references(self, uid: int) -> int:
        """Files (counted once per grant naming them) the uid's live grants and requests
        hold."""
        return self._references[uid]

    def issue(self, peer: Peer, files: list[Adopted]) -> Grant:
        """A token for ``files`` (their references pass to the grant); refused past the
        uid's cap (the caller then still holds the files)."""
        if peer.uid not in self.exempt and self.slots(peer.uid) >= self.max_per_uid:
            raise AccessDeniedError(
                f"uid {peer.uid} already has {self.slots(peer.uid)} live requests and grants "
                f"(--user-max-requests {self.max_per_uid})"
            )
        grant = Grant(secrets.token_urlsafe(32), peer, files, time.monotonic() + self.ttl)
        self._unspent[grant.token] = grant
        self._slots[peer.uid] = self.slots(peer.uid) + 1
        self._references[peer.uid] += grant.references
        return grant

    def spend(self, token: str) -> Grant:
        """The unspent grant behind ``token``, now spent: its slot and files pass to the
        request the caller builds, which ends with :meth:`finished`."""
        grant = self._unspent.pop(token, None) if token else None
        if grant is None:
            raise UnauthenticatedError(
                "no live grant for this token (unknown, already used, or lapsed after "
                f"{self.ttl:.0f} s): open the files and ask the access channel for a new one"
            )
        self._live[token] = grant.peer.uid
        return grant

    def finished(self, grant: Grant) -> None:
        """The request that spent ``grant`` ended (or never started)."""
        if self._live.pop(grant.token, None) is not None:
            self._free_slot(grant)

    def uid_of(self, token: str) -> int | None:
        """The uid behind a live token (unspent, or its request still live)."""
        if not token:
            return None
        grant = self._unspent.get(token)
        if grant is not None:
            return grant.peer.uid
        return self._live.get(token)

    def expire(self, now: float | None = None) -> int:
        """Drop unspent grants past their time and give back their files; how many."""
        now = time.monotonic() if now is None else now
        lapsed = [g for g in self._unspent.values() if g.expires <= now]
        for grant in lapsed:
            del self._unspent[grant.token]
            self._free_slot(grant)
            for file, _ in grant.files:
                self._files.release(file)
        return len(lapsed)

    def close(self) -> None:
        self.expire(float("inf"))

    def _free_slot(self, grant: Grant) -> None:
        uid = grant.peer.uid
        left = self.slots(uid) - 1
        if left > 0:
            self._slots[uid] = left
        else:
            self._slots.pop(uid, None)
        self._references[uid] -= grant.references
        if self._references[uid] <= 0:
            del self._references[uid]


def same_token(a: str, b: str) -> bool:
    """Compare tokens in constant time (no timing oracle on a request's token)."""
    return bool(a) and hmac.compare_digest(a.encode(), b.encode())
