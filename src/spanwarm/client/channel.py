"""The rank's connection to its node's daemon, and the calls that carry its token.

One gRPC channel per :class:`~spanwarm.client.Client`, opened on first use and only
after the socket's place has been checked (:func:`~spanwarm.client.access.check_endpoint`:
not a byte goes to a socket another user could have put there). Every call that names
this rank's files carries the token the access channel gave for them
(:mod:`spanwarm.client.access`): ``Warm`` the token of its grant, ``Consumed`` the token
of its request's ``Warm``, ``Status`` a token of no files, which shows this uid its own
ranks and files.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import grpc

from spanwarm.client.access import AccessRefused, Granted, check_endpoint, grant
from spanwarm.client.reports import Report
from spanwarm.client.wire import message_dict

__all__ = ["CHANNEL_OPTIONS", "MAX_MESSAGE", "DaemonChannel"]

logger = logging.getLogger("spanwarm.client")

MAX_MESSAGE = 128 * 2**20
# Ping an idle connection every 10 s and give up on it 5 s after an unanswered ping: a
# SIGSTOPped or unreachable daemon ends the stream with UNAVAILABLE instead of never.
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE),
    ("grpc.max_receive_message_length", MAX_MESSAGE),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.ping_timeout_ms", 5_000),  # the ack wait that applies here (default 60 s)
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]


class DaemonChannel:
    """The daemon at ``socket``, each unary call bounded by ``timeout`` seconds (lazily
    connected; safe to share across threads)."""

    def __init__(self, socket: str, timeout: float) -> None:
        self.socket = socket
        self.timeout = timeout
        self._channel: grpc.Channel | None = None
        self._lock = threading.Lock()
        self._status_token = ("", 0.0)  # (token, reuse it until this monotonic time)

    def stub(self) -> Any:
        """The Warmer stub; raises :class:`~spanwarm.client.access.EndpointUnsafe` or
        OSError (no daemon there) before the channel is first opened."""
        from spanwarm.rpc.v1 import warmer_pb2_grpc

        with self._lock:
            if self._channel is None:
                check_endpoint(self.socket)  # before a single byte goes to it
                self._channel = grpc.insecure_channel(
                    f"unix:{self.socket}", options=CHANNEL_OPTIONS
                )
            return warmer_pb2_grpc.WarmerStub(self._channel)

    @property
    def open(self) -> bool:
        """Whether the channel has been opened (and not closed since)."""
        with self._lock:
            return self._channel is not None

    def close(self) -> None:
        """Close the channel: calls in flight end CANCELLED; the next call reopens it."""
        with self._lock:
            if self._channel is not None:
                self._channel.close()
                self._channel = None

    def grant(self, paths: Sequence[str]) -> Granted:
        """A token for the files of ``paths`` this process can open (access channel)."""
        return grant(self.socket, list(paths), timeout=self.timeout)

    def warm(self, request: Any, *, timeout: float) -> Any:
        """Start ``Warm``: the stream of the request's events (a call to cancel)."""
        return self.stub().Warm(request, timeout=timeout)

    def consumed_report(self, token: str) -> Report:
        """Sends a batch of ``Consumed`` with ``token``, the request's own (fire and
        forget: the loader must not wait for the daemon between tensors; an error is
        logged, the request having ended already)."""
        from spanwarm.rpc.v1 import warmer_pb2

        stub = self.stub()
        timeout = self.timeout

        def report(request_id: int, groups: list[int]) -> Any:
            future = stub.Consumed.future(
                warmer_pb2.ConsumedRequest(request_id=request_id, groups=groups, token=token),
                timeout=timeout,
            )
            future.add_done_callback(_log_consumed_error)
            return future

        return report

    def status(self) -> dict[str, Any]:
        """The daemon's Status as a dict: this uid's own ranks and files, and the node's
        totals (everything, for root and the daemon's own user). Raises grpc.RpcError
        when it is unreachable, EndpointUnsafe when its socket cannot be trusted."""
        from spanwarm.rpc.v1 import warmer_pb2

        stub = self.stub()
        now = time.monotonic()
        if now >= self._status_token[1]:
            try:  # a grant of no files proves who we are (kept for half its life)
                granted = grant(self.socket, [], timeout=self.timeout)
                self._status_token = (granted.token, now + granted.expires_s / 2)
            except (OSError, AccessRefused) as exc:
                logger.debug("spanwarm: no token for Status (%s): node totals only", exc)
                self._status_token = ("", now)
        request = warmer_pb2.StatusRequest(token=self._status_token[0])
        return message_dict(stub.Status(request, timeout=self.timeout))


def _log_consumed_error(future: Any) -> None:
    if future.exception() is not None:  # the request already ended: nothing to release
        logger.debug("spanwarm: Consumed: %s", future.exception())
