"""The gRPC servicer: decodes requests, hands them to the node, encodes what comes back.

A thin class wiring the parts: who is calling and what it may touch
(:mod:`.authentication`), the per-uid caps (:mod:`.caps`), admission (:mod:`.admission`),
the messages on the wire (:mod:`.wire`) and giving a large call's memory back
(:mod:`.heap`).

Every call ends with a documented status code (docs/daemon.md): a message that does not
decode is INVALID_ARGUMENT, a refusal carries its :mod:`spanwarm.errors` code, and an
unexpected exception is INTERNAL, logged with its traceback, the node left consistent
(a request is released whatever happened to it). UNKNOWN never leaves the daemon. The
handlers are registered by hand, taking raw bytes, so that decoding is ours to answer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine
from typing import Any

import grpc

from spanwarm import __version__
from spanwarm.daemon import wire
from spanwarm.daemon.admission import admit
from spanwarm.daemon.authentication import Authentication
from spanwarm.daemon.caps import UserCaps
from spanwarm.daemon.config import DaemonConfig
from spanwarm.daemon.files import Adopted
from spanwarm.daemon.grants import Grant, Grants
from spanwarm.daemon.heap import (
    LARGE_MESSAGE,
    LARGE_REQUEST_SPANS,
    HeapTrimmer,
    forget_frames,
    trim_heap,
)
from spanwarm.daemon.node import Node
from spanwarm.daemon.request import Event, Request, index_cells
from spanwarm.daemon.span_check import CheckedRequest, decode_and_check, decode_message
from spanwarm.errors import SpanwarmError
from spanwarm.planning.costmodel import FilePlan
from spanwarm.rpc.v1 import warmer_pb2

__all__ = ["HEARTBEAT_SECONDS", "WarmerService"]

logger = logging.getLogger("spanwarm.daemon")

HEARTBEAT_SECONDS = 5.0  # a stream idle this long gets a heartbeat (clients watch for them)
_DECODE_INLINE = 64 * 2**10  # bytes of a Consumed message decoded on the loop
# A request this large is decoded, checked and indexed in a helper process (about a
# millisecond of GIL per thousand spans otherwise); a small one costs less than the trip.
_IN_HELPER = 16 * 2**10  # bytes of a Warm message
_SPANS_IN_HELPER = 1_000


class WarmerService:
    def __init__(self, node: Node, config: DaemonConfig, grants: Grants) -> None:
        self.node = node
        self.config = config
        self.grants = grants
        self.auth = Authentication(
            grants,
            socket=config.socket,
            socket_group=config.socket_group,
            trusted=node.trusted_uids,
        )
        self.caps = UserCaps(
            max_bytes=config.user_max_bytes,
            max_rows=config.user_max_rows,
            exempt=node.trusted_uids,
            live_bytes=node.user_bytes,
            live_rows=node.user_rows,
        )
        self.heap = HeapTrimmer(node.admission_pool)
        self.draining = False
        self.stopping = asyncio.Event()
        self.streams = 0
        self.idle = asyncio.Event()
        self.idle.set()

    def handler(self) -> grpc.GenericRpcHandler:
        """The Warmer service's handlers: requests arrive as bytes, decoded by us."""
        return grpc.method_handlers_generic_handler(
            wire.WARMER,
            {
                "Warm": grpc.unary_stream_rpc_method_handler(
                    self.Warm, response_serializer=warmer_pb2.WarmEvent.SerializeToString
                ),
                "Status": grpc.unary_unary_rpc_method_handler(
                    self.Status, response_serializer=warmer_pb2.StatusReply.SerializeToString
                ),
                "Consumed": grpc.unary_unary_rpc_method_handler(
                    self.Consumed, response_serializer=warmer_pb2.ConsumedReply.SerializeToString
                ),
            },
        )

    async def _refuse(self, context: grpc.aio.ServicerContext, exc: Exception) -> None:
        """End the call with the status code ``exc`` maps to (INTERNAL if unexpected)."""
        if isinstance(exc, SpanwarmError):
            code, text = exc.grpc_code, wire.describe(exc)
        else:
            logger.error("unexpected error: %r", exc, exc_info=exc)
            code, text = "INTERNAL", f"internal error in the daemon: {exc!r}"
        forget_frames(exc)
        self.node.metrics.add(self.node.metrics.errors, 1, code)
        await context.abort(grpc.StatusCode[code], wire.details(text))

    async def Warm(self, data: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        large = len(data) > LARGE_MESSAGE
        stream = self._warm(data, context)
        del data  # the stream may last the whole load: only _warm holds the message
        try:
            async with contextlib.aclosing(stream):
                async for message in stream:
                    yield message
        finally:
            if large:
                self.heap.after_call()

    async def _warm(
        self, data: bytes, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[Any, None]:
        grant: Grant | None = None
        try:
            if self.draining:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "the daemon is shutting down")
            # Decoding 100k spans takes milliseconds, open may block on a network mount,
            # and 1M spans take a while to index: all of it off the loop.
            request: Any = None
            async with contextlib.aclosing(self._off_loop(self._check, data)) as beats:
                async for beat in beats:
                    if beat is None:
                        yield self._heartbeat()
                    request = beat
            grant = self.auth.warm_grant(request.token)
            live = None
            granted = None if grant is None else grant.files
            admission = self._off_loop(
                self._admit, request, granted, abandon=functools.partial(self._abandon, granted)
            )
            async with contextlib.aclosing(admission) as beats:
                async for beat in beats:
                    if beat is None:
                        yield self._heartbeat()
                    live = beat
            assert live is not None
            # The stream may live for the whole load: keep the compact request, not the
            # decoded message (a million spans decode to ~50 MB; grpc keeps the raw bytes).
            del data, request, admission
        except (asyncio.CancelledError, grpc.aio.AbortError):
            if grant is not None:
                self.grants.finished(grant)
            raise
        except Exception as exc:
            if grant is not None:
                self.grants.finished(grant)
            if isinstance(exc, SpanwarmError):
                logger.info("refused a request: %s", exc)
            self.node.refused(exc)
            # The abort's traceback keeps this frame: not the message with it.
            data = request = beat = b""  # noqa: F841
            await self._refuse(context, exc)
            return
        self.streams += 1
        self.idle.clear()
        try:
            if grant is not None:
                live.uid, live.token = grant.peer.uid, grant.token
                self.caps.check(live.uid, live.nbytes, live.rows)
            async for message in self._serve(live):
                yield message
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:
            self.node.refused(exc)
            await self._refuse(context, exc)
        finally:
            self.node.release(live)
            if grant is not None:
                self.grants.finished(grant)
            self.streams -= 1
            if not self.streams:
                self.idle.set()
            if live.spans > LARGE_REQUEST_SPANS:
                self.heap.soon()

    async def _off_loop(
        self,
        fn: Callable[..., Any],
        *args: Any,
        abandon: Callable[[concurrent.futures.Future[Any]], None] | None = None,
    ) -> AsyncGenerator[Any, None]:
        """Run ``fn`` in an admission thread; yield None every heartbeat interval while it
        runs, then its result. If the result is not delivered (the client left, or ``fn``
        raised), ``fn`` is cancelled unless it has started, and ``abandon`` gets the job
        once it is done or cancelled, to give back what it was handed or took."""
        job = self.node.admission_pool.submit(fn, *args)
        waiting = asyncio.wrap_future(job)
        delivered = False
        try:
            while not waiting.done():
                await asyncio.wait([waiting], timeout=HEARTBEAT_SECONDS)
                if not waiting.done():
                    yield None
            result = waiting.result()
            delivered = True
            yield result
        finally:
            if not delivered:
                job.cancel()
                if abandon is not None:
                    job.add_done_callback(abandon)
                waiting.add_done_callback(_retrieved)

    async def _serve(self, live: Request) -> AsyncIterator[Any]:
        """Register the request, send its plan, then its events until it is done and the
        rank has reported what it holds (or the daemon stops)."""
        registration = asyncio.ensure_future(self.node.register(live))
        try:
            while not registration.done():
                await asyncio.wait([registration], timeout=HEARTBEAT_SECONDS)
                if not registration.done():
                    yield self._heartbeat()
            registration.result()
        finally:
            registration.cancel()
        plans = self.node.plan_of(live)
        _log_decisions(live, [p for p, _ in plans])
        yield wire.plan_event(live.id, live.nbytes, plans)
        while True:
            try:
                first = await asyncio.wait_for(live.events.get(), HEARTBEAT_SECONDS)
            except TimeoutError:
                yield self._heartbeat()
                continue
            for message in wire.event_messages(_queued(live, first), live.state):
                yield message
                if message.HasField("done"):
                    # Everything is warm; the stream stays open while the rank holds warmed
                    # bytes it has not reported read (they count against the budget, and
                    # --hold keeps them mapped), or until shutdown.
                    await _first(live.unheld.wait(), self.stopping.wait())
                    return

    def _heartbeat(self) -> Any:
        return wire.heartbeat(
            self.node.bytes_read_total + self.node.bytes_verified_total, self.node.in_flight
        )

    def _abandon(
        self, granted: list[Adopted] | None, job: concurrent.futures.Future[Request]
    ) -> None:
        """An admission nobody will use: give back the grant's files if it never ran, or
        what it took if it succeeded (a refusal gave everything back itself). Runs in the
        admission thread, or here if the job is over already; the file table locks."""
        if job.cancelled():
            for file, _ in granted or ():
                self.node.files.release(file)
        elif job.exception() is None:
            for file in job.result().acquired:
                self.node.files.release(file)

    def _check(self, data: bytes) -> CheckedRequest:
        """Decode and check a Warm request (in an admission thread): a large one in a
        helper process, out of the daemon's GIL."""
        if len(data) > _IN_HELPER:
            return self.node.helpers.call(decode_and_check, data, self.config)
        return decode_and_check(data, self.config)

    def _admit(self, request: CheckedRequest, granted: list[Adopted] | None) -> Request:
        admitted = admit(request, self.node.files, granted)
        large = len(request.offset) > _SPANS_IN_HELPER
        index = functools.partial(self.node.helpers.call, index_cells) if large else index_cells
        try:
            live = Request(admitted, self.node.chunk, index)
        except BaseException:  # MemoryError, a bug: the files go back all the same
            for file in admitted.files:
                self.node.files.release(file)
            raise
        finally:
            spans = sum(len(t) for t in admitted.spans.values())
            if spans > LARGE_REQUEST_SPANS:
                trim_heap(collect=False)  # the decoding and validation temporaries
        return live

    async def Consumed(self, data: bytes, context: grpc.aio.ServicerContext) -> Any:
        return await self._unary(context, self._consumed, data, context)

    async def _consumed(self, data: bytes, context: grpc.aio.ServicerContext) -> Any:
        if len(data) > _DECODE_INLINE:  # a huge report: decode it off the loop
            request_id, groups, token = await asyncio.get_running_loop().run_in_executor(
                self.node.admission_pool, wire.decode_consumed, data
            )
        else:
            request_id, groups, token = wire.decode_consumed(data)
        request = self.node.request(request_id)
        # A request answers to the token its Warm spent; one admitted by name (no token)
        # to calls on an owner-only socket. Anything else looks exactly like no request.
        if request is None or not self.auth.may_consume(request.token, token):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no live request {request_id}")
        assert request is not None  # abort raised otherwise
        self.node.consumed(request, groups)
        return warmer_pb2.ConsumedReply()

    async def Status(self, data: bytes, context: grpc.aio.ServicerContext) -> Any:
        return await self._unary(context, self._status, data)

    async def _status(self, data: bytes) -> Any:
        caller = self.auth.status_caller(decode_message(warmer_pb2.StatusRequest, data).token)
        everything, uid = caller.sees_everything, caller.uid
        status = self.node.status(None if everything else lambda r: r.uid == uid)
        prober = self.node.prober
        return wire.status_reply(
            status,
            version=__version__,
            # What other users' reads taught it is theirs: trusted callers only.
            mounts=[
                (name, rate, sampled, seek_cost, prober is not None and prober.due(name))
                for name, rate, sampled, seek_cost in (
                    self.node.throughput.snapshot() if everything else []
                )
            ],
            # Who was refused what is the operator's to see: trusted callers only.
            refusals=self.node.refusals.snapshot() if everything else [],
        )

    async def _unary(
        self,
        context: grpc.aio.ServicerContext,
        handler: Callable[..., Coroutine[Any, Any, Any]],
        data: bytes,
        *args: Any,
    ) -> Any:
        large = len(data) > LARGE_MESSAGE
        try:
            return await handler(data, *args)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:
            if context.done():
                # The caller went away meanwhile (cancelled, or its deadline passed): no
                # status can reach it, and a refusal would fail again ("Abort already
                # called"), logged as a daemon error. It happens when a rank's last
                # Consumed report races the end of its request and its channel's close.
                logger.debug("call ended by its caller before its answer: %r", exc)
                raise asyncio.CancelledError from exc
            data = b""  # the abort's traceback keeps this frame: not the message with it
            await self._refuse(context, exc)
        finally:
            if large:
                self.heap.after_call()


async def _first(*waits: Coroutine[Any, Any, Any]) -> None:
    """Return when the first of these completes; cancel the others."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()


def _queued(live: Request, first: Event) -> list[Event]:
    """``first`` and every event already queued behind it (sent together: ready groups
    coalesce into one message)."""
    events = [first]
    while not live.events.empty():
        events.append(live.events.get_nowait())
    return events


def _log_decisions(live: Request, plans: list[FilePlan]) -> None:
    """One line per request: what the node plan does with its files, and why."""
    whole = [p for p in plans if p.decision == "whole"]
    seek_costs = sorted({p.seek_cost for p in plans})
    logger.info(
        "job %s rank %d: %d tensors, %d bytes in %d files; node plan: %d files whole, %d as "
        "spans, %d bytes to read (seek cost %s)",
        live.job,
        live.rank,
        len(live.groups),
        live.nbytes,
        len(plans),
        len(whole),
        len(plans) - len(whole),
        sum(p.warm_bytes for p in plans),
        ", ".join(map(str, seek_costs)) or "-",
        extra={
            "fields": {
                "job": live.job,
                "rank": live.rank,
                "files": [
                    {
                        **p.to_json(),
                        "seek_cost_bytes": p.seek_cost,
                        "whole_cost_bytes": p.size_bytes + p.seek_cost,
                    }
                    for p in plans
                ],
            }
        },
    )


def _retrieved(future: asyncio.Future[Any]) -> None:
    """Mark an abandoned future's outcome as seen (asyncio would log it as never retrieved)."""
    if not future.cancelled():
        future.exception()
