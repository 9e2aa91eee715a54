"""Refused connections, grants and Warm requests, counted by cause, for ``spanwarm
status`` and metrics.

A refusal reaches only the caller (its rank logs one warning and loads cold), so a
mistake the operator made, like a checkpoint mounted at another path for the daemon
than for the jobs, would otherwise show nowhere on the daemon's side. Counted on the
event loop: no locks.
"""

from __future__ import annotations

import collections

from spanwarm.errors import (
    AccessDeniedError,
    ElsewhereForDaemonError,
    InvalidRequestError,
    NotARegularFileError,
    OutsideAllowedRootsError,
    PathNotAllowedError,
    RequestTooLargeError,
    ShardMissingError,
    SpanOutOfRangeError,
    SpanwarmError,
    StorageError,
    TooManyConnectionsError,
    UnauthenticatedError,
)

__all__ = ["Refusals", "cause_of"]

# Most specific first: the subclasses of PathNotAllowedError before it.
_CAUSES: tuple[tuple[type[SpanwarmError], str], ...] = (
    (OutsideAllowedRootsError, "outside_allowed_roots"),
    (ElsewhereForDaemonError, "elsewhere_for_daemon"),
    (PathNotAllowedError, "not_readable"),
    (AccessDeniedError, "access_denied"),
    (NotARegularFileError, "not_a_regular_file"),
    (ShardMissingError, "not_found"),
    (SpanOutOfRangeError, "out_of_range"),
    (StorageError, "storage"),
    (TooManyConnectionsError, "too_many_connections"),
    (RequestTooLargeError, "over_a_limit"),
    (InvalidRequestError, "invalid_request"),
    (UnauthenticatedError, "unauthenticated"),
)


def cause_of(exc: BaseException) -> str:
    """A short, stable name for why ``exc`` refused a call (the gRPC code's, lower case,
    where no finer cause applies; ``internal`` for a bug)."""
    for kind, cause in _CAUSES:
        if isinstance(exc, kind):
            return cause
    if isinstance(exc, TimeoutError):
        return "deadline_exceeded"
    if isinstance(exc, SpanwarmError):
        return exc.grpc_code.lower()
    return "internal"


class Refusals:
    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()

    def count(self, exc: BaseException) -> str:
        """Count one refusal; its cause."""
        cause = cause_of(exc)
        self.counts[cause] += 1
        return cause

    def snapshot(self) -> list[tuple[str, int]]:
        """(cause, count) since start, most frequent first."""
        return self.counts.most_common()
