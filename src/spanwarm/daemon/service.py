"""The gRPC servicer: decodes requests, hands them to the node, encodes what comes back.

Who is calling comes from the call's token (:mod:`spanwarm.daemon.grants`): a ``Warm``
spends a grant and warms exactly the files it proved, ``Consumed`` needs the token of
its request's own ``Warm``, and ``Status`` shows a caller other than root or the
daemon's user its own ranks only. Without a token, only an owner-only socket (mode
0600: nobody but the daemon's user and root can connect) is served, as that user.

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
import os
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt
from google.protobuf.descriptor import FieldDescriptor

from spanwarm import __version__
from spanwarm.daemon.admission import admit
from spanwarm.daemon.config import DaemonConfig
from spanwarm.daemon.files import Adopted
from spanwarm.daemon.grants import Grant, Grants, same_token
from spanwarm.daemon.heap import trim_heap
from spanwarm.daemon.node import Node
from spanwarm.daemon.request import FAILED, READY, Event, Request, index_cells
from spanwarm.daemon.span_check import CheckedRequest, decode_and_check, decode_message
from spanwarm.errors import (
    CheckpointError,
    RequestTooLargeError,
    SpanwarmError,
    UnauthenticatedError,
)
from spanwarm.planning.costmodel import FilePlan
from spanwarm.rpc.v1 import warmer_pb2

__all__ = ["HEARTBEAT_SECONDS", "WARMER", "WarmerService"]

logger = logging.getLogger("spanwarm.daemon")

WARMER = warmer_pb2.DESCRIPTOR.services_by_name["Warmer"].full_name
HEARTBEAT_SECONDS = 5.0  # a stream idle this long gets a heartbeat (clients watch for them)
_MAX_DETAILS = 1000  # characters of a status message (it travels in a header)
_PATH_SHOWN = 400  # characters of a path quoted in a refusal (its head and its tail)
_DECODE_INLINE = 64 * 2**10  # bytes of a Consumed message decoded on the loop
_LARGE = 10_000  # spans: a request this large has its memory given back when done
# A request this large is decoded, checked and indexed in a helper process (about a
# millisecond of GIL per thousand spans otherwise); a small one costs less than the trip.
_IN_HELPER = 16 * 2**10  # bytes of a Warm message
_SPANS_IN_HELPER = 1_000
# A message this large has its memory given back when its call ends, however it ends: a
# refusal's exception holds the handler's frame (the raw and the decoded message) in a
# reference cycle that only the collector frees, and a daemon that allocates little
# seldom runs a full collection (six refused 104 MB Warms held 2.7 GB, found by an
# attack run).
_LARGE_MESSAGE = 4 * 2**20
_TRIM_AGAIN_S = 5.0

_LIMITS = {
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
}


def _message(cls: Any, fields: dict[str, Any]) -> Any:
    """``cls(**fields)``, integers saturated to their field's range: a total that grew
    past 2**64 shows as the largest value instead of failing the whole reply."""
    known = cls.DESCRIPTOR.fields_by_name
    values = {}
    for name, value in fields.items():
        field = known.get(name)
        if field is None:
            continue
        bounds = _LIMITS.get(field.type)
        if bounds is not None and isinstance(value, int):
            value = min(max(value, bounds[0]), bounds[1])
        values[name] = value
    return cls(**values)


def _file_plan(fields: dict[str, Any]) -> Any:
    return _message(warmer_pb2.FilePlan, fields)  # _message drops keys the proto lacks


def _details(text: str) -> str:
    """A status message that fits the header it travels in: ASCII (gRPC percent-encodes
    every other byte, tripling it: 1,000 emoji would be 12 KB, past a client's 8 KiB
    metadata limit) and at most ``_MAX_DETAILS`` characters."""
    text = _ascii(text)
    return text if len(text) <= _MAX_DETAILS else text[: _MAX_DETAILS - 3] + "..."


def _ascii(text: str) -> str:
    return text.encode("ascii", "backslashreplace").decode("ascii")


def _describe(exc: SpanwarmError) -> str:
    """The refusal's message; a caller's long path is shortened in the middle (after
    escaping, which can make a character ten), so the cause and the offset after it
    always fit in the message."""
    if not isinstance(exc, CheckpointError):
        return str(exc)
    path = _ascii(exc.path)
    if len(path) > _PATH_SHOWN:
        half = _PATH_SHOWN // 2
        path = f"{path[:half]}...{path[-half:]}"
    where = f" (at offset {exc.offset})" if exc.offset is not None else ""
    return f"{path}: {exc.cause}{where}"


def _forget_frames(exc: BaseException) -> None:
    """Drop the tracebacks of ``exc`` and the exceptions it chains to: they hold the frames
    that raised them, and those the request's messages; the exception itself lives on
    (grpc keeps the abort it leads to, chained to it, for a while after the call)."""
    seen: set[int] = set()
    chained: BaseException | None = exc
    while chained is not None and id(chained) not in seen:
        seen.add(id(chained))
        chained.__traceback__ = None
        chained = chained.__cause__ or chained.__context__


def _decode_consumed(data: bytes) -> tuple[int, npt.NDArray[np.int64], str]:
    request = decode_message(warmer_pb2.ConsumedRequest, data)
    groups = np.fromiter(request.groups, dtype=np.int64, count=len(request.groups))
    return request.request_id, groups, request.token


class WarmerService:
    def __init__(self, node: Node, config: DaemonConfig, grants: Grants) -> None:
        self.node = node
        self.config = config
        self.grants = grants
        self.draining = False
        self.stopping = asyncio.Event()
        self.streams = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self._trim_pending = False
        self._trim_again = False

    def handler(self) -> grpc.GenericRpcHandler:
        """The Warmer service's handlers: requests arrive as bytes, decoded by us."""
        return grpc.method_handlers_generic_handler(
            WARMER,
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
            code, text = exc.grpc_code, _describe(exc)
        else:
            logger.error("unexpected error: %r", exc, exc_info=exc)
            code, text = "INTERNAL", f"internal error in the daemon: {exc!r}"
        _forget_frames(exc)
        self.node.metrics.add(self.node.metrics.errors, 1, code)
        await context.abort(grpc.StatusCode[code], _details(text))

    def owner_only(self) -> bool:
        """True when nobody but the daemon's own user (and root) can connect: no socket
        group, and the socket's mode gives the group and others nothing (checked on
        every call: an operator's chmod counts at once)."""
        if self.config.socket_group:
            return False
        try:
            return not os.stat(self.config.socket).st_mode & 0o077
        except OSError:
            return False

    def _unproven(self, what: str) -> UnauthenticatedError:
        return UnauthenticatedError(
            f"{what} needs a token: this socket is shared, so callers prove which files they "
            f"may read by passing their descriptors on {self.config.socket}.access "
            "(spanwarm.client does this)"
        )

    async def Warm(self, data: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        large = len(data) > _LARGE_MESSAGE
        stream = self._warm(data, context)
        del data  # the stream may last the whole load: only _warm holds the message
        try:
            async with contextlib.aclosing(stream):
                async for message in stream:
                    yield message
        finally:
            if large:
                self._trim_after_call()

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
            if request.token:
                grant = self.grants.spend(request.token)
            elif not self.owner_only():
                raise self._unproven("Warm")
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
                self._check_user_caps(live.uid, live)
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
            if live.spans > _LARGE:
                self._trim_soon()

    def _check_user_caps(self, uid: int, request: Request) -> None:
        """Refuse a request that takes its uid past ``--user-max-bytes`` or
        ``--user-max-rows`` (checked once it is admitted: what it names is exact then).
        Rows are the node's cost, not the request's: planning expands the strided rows of
        every live request on a file together, so one user's requests, each within
        ``--max-rows``, took GBs and held up everyone's registration for seconds."""
        if uid in self.node.trusted_uids:
            return
        cap = self.config.user_max_bytes
        if cap is not None and self.node.user_bytes(uid) + request.nbytes > cap:
            raise RequestTooLargeError(
                f"uid {uid}'s live requests would name more than {cap} bytes (--user-max-bytes)"
            )
        rows = self.config.user_max_rows
        if request.rows and self.node.user_rows(uid) + request.rows > rows:
            raise RequestTooLargeError(
                f"uid {uid}'s live requests would have more than {rows} rows of strided "
                "spans (--user-max-rows)"
            )

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

    def _trim_after_call(self) -> None:
        """Collect and trim soon after a large call, and once more a while later: grpc lets
        go of a call's objects (and, through its abort, of what they hold) some time after
        the call ends."""
        self._trim_soon()
        with contextlib.suppress(RuntimeError):  # the loop is ending: nothing to trim
            asyncio.get_running_loop().call_later(_TRIM_AGAIN_S, self._trim_soon)

    def _trim_soon(self) -> None:
        """Collect and trim the heap once this call's frame has let go of it (off the loop:
        it takes tens of milliseconds). One trim pending at a time; a call that ends while
        one is pending gets one more after it (its garbage may not exist yet when the
        pending one runs)."""
        if self._trim_pending:
            self._trim_again = True
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # a stream closed as the loop ends: nothing left to trim
            return
        self._trim_pending = True
        loop.call_later(0.5, self._trim, loop)

    def _trim(self, loop: asyncio.AbstractEventLoop) -> None:
        again, self._trim_again = self._trim_again, False
        try:
            job = self.node.admission_pool.submit(trim_heap, collect=True)
        except RuntimeError:  # the pool has shut down: we are exiting
            self._trim_pending = False
            return

        def done() -> None:
            self._trim_pending = False
            if again:
                self._trim_soon()

        def back_on_the_loop(_: object) -> None:
            with contextlib.suppress(RuntimeError):  # the loop has closed: we are exiting
                loop.call_soon_threadsafe(done)

        job.add_done_callback(back_on_the_loop)

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
        yield warmer_pb2.WarmEvent(
            plan=_message(
                warmer_pb2.Plan,
                {
                    "request_id": live.id,
                    "request_bytes": live.nbytes,
                    # Per mount (learned, or --seek-cost): the largest among these files'.
                    "seek_cost_bytes": max((p.seek_cost for p, _ in plans), default=0),
                    "files": [
                        _file_plan({**p.to_json(), "stream_bytes_per_s": rate}) for p, rate in plans
                    ],
                },
            )
        )
        while True:
            try:
                first = await asyncio.wait_for(live.events.get(), HEARTBEAT_SECONDS)
            except TimeoutError:
                yield self._heartbeat()
                continue
            for message in _coalesce(live, first):
                yield message
                if message.HasField("done"):
                    # Everything is warm; the stream stays open while the rank holds warmed
                    # bytes it has not reported read (they count against the budget, and
                    # --hold keeps them mapped), or until shutdown.
                    await _first(live.unheld.wait(), self.stopping.wait())
                    return

    def _heartbeat(self) -> Any:
        return warmer_pb2.WarmEvent(
            heartbeat=_message(
                warmer_pb2.Heartbeat,
                {
                    "bytes_done": self.node.bytes_read_total + self.node.bytes_verified_total,
                    "in_flight": self.node.in_flight,
                },
            )
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
            if admitted.spans and sum(len(t) for t in admitted.spans.values()) > _LARGE:
                trim_heap(collect=False)  # the decoding and validation temporaries
        return live

    async def Consumed(self, data: bytes, context: grpc.aio.ServicerContext) -> Any:
        return await self._unary(context, self._consumed, data, context)

    async def _consumed(self, data: bytes, context: grpc.aio.ServicerContext) -> Any:
        if len(data) > _DECODE_INLINE:  # a huge report: decode it off the loop
            request_id, groups, token = await asyncio.get_running_loop().run_in_executor(
                self.node.admission_pool, _decode_consumed, data
            )
        else:
            request_id, groups, token = _decode_consumed(data)
        request = self.node.request(request_id)
        # A request answers to the token its Warm spent; one admitted by name (no token)
        # to calls on an owner-only socket. Anything else looks exactly like no request.
        if request is None or not (
            same_token(request.token, token) if request.token else not token and self.owner_only()
        ):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no live request {request_id}")
        assert request is not None  # abort raised otherwise
        self.node.consumed(request, groups)
        return warmer_pb2.ConsumedReply()

    async def Status(self, data: bytes, context: grpc.aio.ServicerContext) -> Any:
        return await self._unary(context, self._status, data)

    async def _status(self, data: bytes) -> Any:
        token = decode_message(warmer_pb2.StatusRequest, data).token
        if token:
            uid = self.grants.uid_of(token)
            if uid is None:
                raise UnauthenticatedError(
                    "Status: no live token like this one (unknown, or lapsed): ask the "
                    "access channel for a new one, or call without a token for node totals"
                )
            everything = uid in self.node.trusted_uids
        else:
            uid, everything = None, self.owner_only()
        status = self.node.status(None if everything else lambda r: r.uid == uid)
        learned = self.node.throughput.snapshot() if everything else []
        prober = self.node.prober
        return _message(
            warmer_pb2.StatusReply,
            {
                **status,
                "version": __version__,
                "ranks": [_message(warmer_pb2.RankStatus, r) for r in status["ranks"]],
                "files": [_file_plan(f) for f in status["files"]],
                # What other users' reads taught it is theirs: trusted callers only.
                "mounts": [
                    _message(
                        warmer_pb2.MountStatus,
                        {
                            "mount": name,
                            "stream_bytes_per_s": rate,
                            "sampled_bytes": sampled,
                            "seek_cost_bytes": seek_cost,
                            "seek_probe_due": prober is not None and prober.due(name),
                        },
                    )
                    for name, rate, sampled, seek_cost in learned
                ],
                # Who was refused what is the operator's to see: trusted callers only.
                "refusals": [
                    warmer_pb2.RefusalCount(cause=cause, count=count)
                    for cause, count in (self.node.refusals.snapshot() if everything else [])
                ],
            },
        )

    async def _unary(
        self,
        context: grpc.aio.ServicerContext,
        handler: Callable[..., Coroutine[Any, Any, Any]],
        data: bytes,
        *args: Any,
    ) -> Any:
        large = len(data) > _LARGE_MESSAGE
        try:
            return await handler(data, *args)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:
            if context.done():
                # The caller went away meanwhile (cancelled, or its deadline passed): no
                # status can reach it, and a refusal would fail again ("Abort already
                # called"), logged as a daemon error. Seen when a rank's last Consumed
                # report raced the end of its request and its channel's close.
                logger.debug("call ended by its caller before its answer: %r", exc)
                raise asyncio.CancelledError from exc
            data = b""  # the abort's traceback keeps this frame: not the message with it
            await self._refuse(context, exc)
        finally:
            if large:
                self._trim_after_call()


async def _first(*waits: Coroutine[Any, Any, Any]) -> None:
    """Return when the first of these completes; cancel the others."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()


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


def _coalesce(live: Request, first: Event) -> list[Any]:
    """The messages for ``first`` and every event already queued behind it: ready groups
    coalesce into one message."""
    events = [first]
    while not live.events.empty():
        events.append(live.events.get_nowait())
    messages = []
    ready = [g for e in events if e.kind == "ready" for g in e.groups]
    if ready:
        messages.append(warmer_pb2.WarmEvent(ready=warmer_pb2.Ready(groups=ready)))
    messages += [_failed(event) for event in events if event.kind == "failed"]
    if any(event.kind == "done" for event in events):
        messages.append(
            warmer_pb2.WarmEvent(
                done=warmer_pb2.Done(
                    ready=int((live.state == READY).sum()), failed=int((live.state == FAILED).sum())
                )
            )
        )
    return messages


def _failed(event: Event) -> Any:
    return warmer_pb2.WarmEvent(
        failed=warmer_pb2.Failed(
            groups=list(event.groups), code=event.code, reason=_details(event.reason)
        )
    )
