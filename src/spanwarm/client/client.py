"""The rank side of the daemon protocol: ``Client.request_spans`` -> ``Ticket.wait``.

A request returns at once with a :class:`Ticket`; a background thread consumes the
daemon's stream and marks tensors ready as their bytes are warm. spanwarm must never
fail or stall a job: if the daemon is absent, dies, or answers with an error, one
warning is logged and every tensor not yet ready is released (the loader then reads
cold, as it would without spanwarm). ``SPANWARM_DISABLE=1`` makes every request a no-op.

The daemon warms only what this process proves it may read: before ``Warm``, the client
opens the request's files itself and passes the descriptors on the access channel
(:mod:`spanwarm.client.access`), which answers with a token the calls carry. A file this
process cannot open is not requested: its tensors are released at once (their load
would fail the same way without spanwarm). A socket in a place another user controls
is never contacted: one warning, and the load goes on without prefetch.

A daemon that is there but stuck must not stall the job either. The channel sends
keepalive pings (a frozen or partitioned daemon fails them within 15 s), and a
watchdog releases the ticket when ``stall_timeout`` (30 s) passes with no progress: no
event for this request's tensors and no movement in the node's heartbeats
(:mod:`.stall`).

The parts: :mod:`.wire` numbers the spans and packs them into a request,
:mod:`.residency_check` finds what is in the page cache already, :mod:`.channel` talks
to the daemon, :class:`Ticket` (:mod:`.ticket`) holds each tensor's state and decides,
with :mod:`.read_policy`, when a reader waits.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import grpc
import numpy as np

from spanwarm.checkpoint.conversions import Conversion
from spanwarm.checkpoint.resolve import Checkpoint, open_checkpoint
from spanwarm.checkpoint.tensor_layout import TensorSpans
from spanwarm.client.access import AccessRefused, EndpointUnsafe, check_endpoint
from spanwarm.client.channel import DaemonChannel
from spanwarm.client.environment import disabled_by_environment, job_id, this_rank
from spanwarm.client.own_reads import OwnReads
from spanwarm.client.rank_spans import KeyMap, rank_spans
from spanwarm.client.residency_check import ResidencyCheck, distinct, resident_files
from spanwarm.client.stall import watch
from spanwarm.client.tensor_state import Progress, TensorState
from spanwarm.client.ticket import Ticket
from spanwarm.client.wire import NumberedSpans, SpanColumns, drop_files, message_dict
from spanwarm.endpoint import default_socket_path

__all__ = ["Client", "Progress", "Ticket", "disabled_by_environment", "message_dict"]

logger = logging.getLogger("spanwarm.client")

# request() checks residency in line for about this long, while files are resident.
_INLINE_CHECK_S = 0.01


class Client:
    """A connection to the node's daemon (lazily opened; safe to share across threads)."""

    def __init__(
        self,
        socket: str | None = None,
        timeout: float = 10.0,
        *,
        stream_timeout: float = 6 * 3600,
        stall_timeout: float = 30.0,
        read_yourself: bool = True,
    ) -> None:
        if not stall_timeout > 0:
            raise ValueError(f"stall_timeout: must be > 0 seconds, got {stall_timeout!r}")
        self.socket = socket or default_socket_path()
        self.timeout = timeout
        self.stream_timeout = stream_timeout
        self.stall_timeout = stall_timeout
        """Release a ticket whose daemon shows no progress for this long (seconds)."""
        self.read_yourself = read_yourself
        """``Ticket.wait_for_read`` stops waiting once reading a tensor here would be sooner,
        and tensors resident when a request goes out are read at once and not asked for
        (False: every tensor goes to the daemon and ``wait_for_read`` waits like ``wait``,
        e.g. to see every tensor warmed by the daemon, or to have ``--hold`` pin it)."""
        self.disabled = disabled_by_environment()
        self._channel = DaemonChannel(self.socket, timeout)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request_spans(
        self,
        state_dict: Mapping[str, Any],
        checkpoint: Any,
        *,
        job: str | None = None,
        key_map: KeyMap | None = None,
        conversions: Sequence[Conversion] = (),
        unmatched: Literal["warm", "skip"] = "warm",
    ) -> Ticket:
        """Ask the daemon to warm what this rank will read of ``checkpoint`` (safetensors
        files, sliced with ``get_slice``: each sliced tensor's first page is asked for too,
        see :mod:`.first_pages`); returns at once."""
        if self.disabled:
            return self._released([])
        try:
            ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else open_checkpoint(checkpoint)
            spans = rank_spans(
                state_dict,
                ckpt,
                key_map=key_map,
                conversions=conversions,
                unmatched=unmatched,
                first_pages=True,
            )
        except Exception as exc:  # a prefetch problem must never fail the load
            logger.warning("spanwarm: cannot compute spans (%s); loading without prefetch", exc)
            return self._released([])
        return self.request(spans, job=job)

    def request(
        self, spans: Sequence[TensorSpans], *, job: str | None = None, rank: int | None = None
    ) -> Ticket:
        """Ask the daemon to warm ``spans`` (grouped by their tensor); returns at once."""
        spans = spans if isinstance(spans, (list, tuple)) else list(spans)  # read twice
        numbered = NumberedSpans.of(spans)
        ticket = Ticket(numbered.tensors, numbered.nbytes)
        if self.disabled:
            ticket._release()
            return ticket
        check = None
        if self.read_yourself:
            # In line while the files are resident, for up to about 10 ms: a resident
            # checkpoint is found so in 1-2 ms, with no thread to hand the loader's first
            # tensors over (a second thread of the rank's interpreter wins the GIL back
            # after each of its system calls: the loader waited 2-6 ms for its first
            # tensor behind that check). First in plain ints (resident_files: nothing
            # else to build where every file is resident), then, from the first file
            # that is not, with the full check's counts; the rest goes on the ticket's
            # thread.
            began = time.monotonic()
            try:
                paths = numbered.files
                envelopes = numbered.file_envelopes()
                settled = resident_files(paths, envelopes, budget_s=_INLINE_CHECK_S)
                if settled == len(paths) and numbered.tensors:
                    ticket._resident_throughout()
                    return self._answered_in_line(ticket)
                columns = numbered.columns()
                check = ResidencyCheck(ticket, columns, settled=settled)
                left = _INLINE_CHECK_S - (time.monotonic() - began)
                everything = check.run(budget_s=max(left, 0.0)) and check.resident.all()
            except Exception as exc:  # a prefetch problem must never fail the load
                logger.warning("spanwarm: %s; loading without prefetch", exc)
                if check is not None:
                    check.close()
                ticket._release()
                return ticket
            if everything and numbered.tensors:
                check.close()
                ticket._release()  # every tensor resident (some within their slack)
                return self._answered_in_line(ticket)
        else:
            columns = numbered.columns()
        header = {"job": job_id(job), "rank": this_rank() if rank is None else rank}
        thread = threading.Thread(
            target=self._consume,
            args=(ticket, columns, header, check),
            name="spanwarm-ticket",
            daemon=True,
        )
        thread.start()
        return ticket

    def _answered_in_line(self, ticket: Ticket) -> Ticket:
        """``ticket``, every tensor of it resident: nothing to ask for, no thread. A few
        stats, though: an operator still hears of a missing or unsafe daemon."""
        try:
            check_endpoint(self.socket)
        except (EndpointUnsafe, OSError) as exc:
            self._warn_unreachable(exc)
        return ticket

    def _watch(self, ticket: Ticket) -> None:
        """Release the ticket when the daemon makes no progress for ``stall_timeout``."""
        stalled = watch(
            ticket.finished, ticket._stalled_for, ticket._release_stalled, self.stall_timeout
        )
        if stalled is not None and stalled[1]:
            logger.warning(
                "spanwarm: daemon at %s made no progress for %.0f s; %d tensors load "
                "without prefetch",
                self.socket,
                *stalled,
            )

    def _begin(self, ticket: Ticket) -> None:
        """The watchdog (started here, not by request(): starting a thread waits for it to
        run, and the loader's thread has better things to do), before anything that may
        hang (a frozen mount under the rest of the residency check; the part request()
        does in line opens files the loader is about to open itself, and would hang it
        the same way); then the socket's check: no daemon, or not one to trust, releases
        the ticket at once."""
        threading.Thread(
            target=self._watch, args=(ticket,), name="spanwarm-watchdog", daemon=True
        ).start()
        check_endpoint(self.socket)

    def _warn_unreachable(self, exc: EndpointUnsafe | OSError) -> None:
        if isinstance(exc, EndpointUnsafe):
            logger.warning(
                "spanwarm: not using the daemon socket %s: %s; loading without prefetch",
                self.socket,
                exc,
            )
        else:
            logger.warning(
                "spanwarm: daemon at %s: UNAVAILABLE: %s; loading without prefetch",
                self.socket,
                exc.strerror or exc,
            )

    def _consume(
        self,
        ticket: Ticket,
        spans: SpanColumns,
        header: dict[str, Any],
        check: ResidencyCheck | None,
    ) -> None:
        """The ticket's thread: the rest of the residency check, the grant, the request,
        then the daemon's events into the ticket until the stream ends. Whatever
        happens, the ticket ends released: nothing is left waiting on it."""
        from spanwarm.rpc.v1 import warmer_pb2

        try:
            if self.read_yourself:
                # Before anything else: the loader reads its first tensors itself while the
                # request is being built and proved, and each of those reads unhinted is a
                # fault reading a whole read-ahead window (and leaving marks that read
                # more), 8-16 MiB for a slice of one.
                ticket._keep_own_reads(OwnReads.of(spans))
            # First, before the grant and the plan: a rank reads the tensors resident
            # already at once instead of waiting for the daemon's answer, and asks only
            # for the others. Nothing could make those sooner, and the daemon's work for
            # them (grant, admission, events, reports) would take CPU from the load on
            # the node's cores; where every tensor is resident, nothing goes out at all.
            # The loader may look tensors up itself from the check's first step on.
            if check is None:
                self._begin(ticket)
            else:
                try:
                    self._begin(ticket)
                    check.run()
                finally:
                    check.close()
                kept = spans.kept(~check.resident[spans.group_index])
                if kept is None:
                    return
                spans = kept
            request = warmer_pb2.WarmRequest(groups=ticket._names, **header)
            request, token = self._prove(ticket, spans.into(request))
            if request is None or ticket.finished.is_set():  # cancelled or released meanwhile
                return
            if self.read_yourself and ticket._keep_back(
                distinct(np.asarray(request.group_index, dtype=np.int64))
            ):
                return
            if self.read_yourself:  # as sent: _prove renumbers files when one would not open
                ticket._sending(request)
            call = self._channel.warm(request, timeout=self.stream_timeout)
            ticket._call = call
            if ticket.finished.is_set():  # cancel() or the watchdog ran before _call was set
                call.cancel()
            for event in call:
                kind = event.WhichOneof("event")
                if kind == "heartbeat":
                    ticket._heartbeat(event.heartbeat.bytes_done)
                elif kind == "plan":
                    ticket._progressed()
                    ticket.plan = [message_dict(f) for f in event.plan.files]
                    if self.read_yourself:
                        ticket._learn_read_times(list(event.plan.files), list(request.files))
                    ticket._attach(event.plan.request_id, self._channel.consumed_report(token))
                elif kind == "ready":
                    ticket._mark(event.ready.groups, TensorState.READY)
                elif kind == "failed":
                    ticket._mark(
                        event.failed.groups,
                        TensorState.FAILED,
                        f"{event.failed.code}: {event.failed.reason}",
                    )
                # After "done" the daemon keeps the stream open until this rank has
                # reported (Ticket.consumed) what it holds; the loop ends with the stream.
            pending = ticket._still_pending()
            if pending and not ticket.finished.is_set():  # ended by the daemon, not us
                logger.warning(
                    "spanwarm: daemon at %s ended the stream with %d tensors not warm; they "
                    "load without prefetch",
                    self.socket,
                    pending,
                )
        except (EndpointUnsafe, OSError) as exc:
            self._warn_unreachable(exc)
        except AccessRefused as exc:
            logger.warning(
                "spanwarm: daemon at %s refused the files: %s; loading without prefetch",
                self.socket,
                exc,
            )
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED and not ticket._stalled:
                logger.warning(
                    "spanwarm: daemon at %s: %s: %s; the rest loads without prefetch",
                    self.socket,
                    exc.code().name,
                    exc.details(),
                )
        except Exception as exc:  # a prefetch problem must never fail the load
            logger.warning("spanwarm: %s; the rest loads without prefetch", exc)
        finally:
            if ticket.failures:
                name, reason = next(iter(ticket.failures.items()))
                logger.warning(
                    "spanwarm: %d tensors could not be warmed (first: %s: %s)",
                    len(ticket.failures),
                    name,
                    reason,
                )
            ticket._release()

    def _prove(self, ticket: Ticket, request: Any) -> tuple[Any, str]:
        """Pass the request's files to the daemon and return the request with its token,
        naming only the files this process could open (None: nothing is left to warm),
        and the token. Tensors with a byte in a file that would not open are released
        now."""
        granted = self._channel.grant(request.files)
        request.token = granted.token
        ticket._granted(granted.stream_bytes_per_s)
        request, unopened = drop_files(request, granted.failures)
        for groups, reason in unopened:
            ticket._mark(groups, TensorState.FAILED, f"NOT_REQUESTED: {reason}")
        return request, granted.token

    def status(self) -> dict[str, Any]:
        """The daemon's Status as a dict: this uid's own ranks and files, and the node's
        totals (everything, for root and the daemon's own user). Raises grpc.RpcError
        when it is unreachable, EndpointUnsafe when its socket cannot be trusted."""
        return self._channel.status()

    def _released(self, names: list[str]) -> Ticket:
        ticket = Ticket(names, [0] * len(names))
        ticket._release()
        return ticket
