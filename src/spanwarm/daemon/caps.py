"""Per-uid caps on what a user's live requests name: ``--user-max-bytes`` and
``--user-max-rows``, checked on a request once it is admitted (what it names is exact then)
against the requests of its uid already live. Root and the daemon's user are exempt.

Rows are the node's cost, not the request's: planning expands the strided rows of every
live request on a file together, so one user's requests, each within ``--max-rows``, can
take GBs and hold up everyone's registration for seconds without a cap per user.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

from spanwarm.errors import RequestTooLargeError

__all__ = ["UserCaps"]


@dataclass(frozen=True)
class UserCaps:
    """The caps, and how to count what a uid's live requests name already."""

    max_bytes: int | None  # --user-max-bytes (None: no cap)
    max_rows: int  # --user-max-rows
    exempt: Collection[int]  # uids with no caps: root and the daemon's user
    live_bytes: Callable[[int], int]  # bytes a uid's live requests name
    live_rows: Callable[[int], int]  # rows of strided spans a uid's live requests have

    def check(self, uid: int, nbytes: int, rows: int) -> None:
        """Raise :class:`RequestTooLargeError` if a request of ``uid`` naming ``nbytes``
        bytes in ``rows`` strided rows takes its uid past a cap."""
        if uid in self.exempt:
            return
        cap = self.max_bytes
        if cap is not None and self.live_bytes(uid) + nbytes > cap:
            raise RequestTooLargeError(
                f"uid {uid}'s live requests would name more than {cap} bytes (--user-max-bytes)"
            )
        if rows and self.live_rows(uid) + rows > self.max_rows:
            raise RequestTooLargeError(
                f"uid {uid}'s live requests would have more than {self.max_rows} rows of "
                "strided spans (--user-max-rows)"
            )
