"""The gRPC servicer: decodes requests, hands them to the node, encodes what comes back.

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
import ctypes
import gc
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError

from spanwarm import __version__
from spanwarm.costmodel import FilePlan
from spanwarm.daemon.admission import admit
from spanwarm.daemon.config import DaemonConfig
from spanwarm.daemon.node import Node
from spanwarm.daemon.request import FAILED, READY, Event, Request
from spanwarm.errors import CheckpointError, InvalidRequestError, SpanwarmError
from spanwarm.rpc.v1 import warmer_pb2

__all__ = ["HEARTBEAT_SECONDS", "WARMER", "WarmerService"]

try:
    _malloc_trim: Any = ctypes.CDLL(None).malloc_trim  # glibc only
except AttributeError:
    _malloc_trim = None

logger = logging.getLogger("spanwarm.daemon")

WARMER = warmer_pb2.DESCRIPTOR.services_by_name["Warmer"].full_name
HEARTBEAT_SECONDS = 5.0  # a stream idle this long gets a heartbeat (clients watch for them)
_MAX_DETAILS = 1000  # characters of a status message (it travels in a header)
_PATH_SHOWN = 400  # characters of a path quoted in a refusal (its head and its tail)
_DECODE_INLINE = 64 * 2**10  # bytes of a Consumed message decoded on the loop
_LARGE = 10_000  # spans: a request this large has its memory given back when done

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


def _decode(cls: Any, data: bytes) -> Any:
    try:
        return cls.FromString(data)
    except (DecodeError, ValueError) as exc:
        raise InvalidRequestError(f"not a valid {cls.DESCRIPTOR.name}: {exc}") from None


def _decode_consumed(data: bytes) -> tuple[int, npt.NDArray[np.int64]]:
    request = _decode(warmer_pb2.ConsumedRequest, data)
    groups = np.fromiter(request.groups, dtype=np.int64, count=len(request.groups))
    return request.request_id, groups


class WarmerService:
    def __init__(self, node: Node, config: DaemonConfig) -> None:
        self.node = node
        self.config = config
        self.draining = False
        self.stopping = asyncio.Event()
        self.streams = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self._trim_pending = False

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
        self.node.metrics.add(self.node.metrics.errors, 1, code)
        await context.abort(grpc.StatusCode[code], _details(text))

    async def Warm(self, data: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            if self.draining:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "the daemon is shutting down")
            live = None
            # Decoding 100k spans takes milliseconds, stat/open may block on a network
            # mount, and 1M spans take a while to index: all of it off the loop.
            job = self.node.admission_pool.submit(self._admit, data)
            admission = asyncio.wrap_future(job)
            try:
                while not admission.done():
                    await asyncio.wait([admission], timeout=HEARTBEAT_SECONDS)
                    if not admission.done():
                        yield self._heartbeat()
                live = admission.result()
            finally:
                if live is None:  # refused, or the client left: give back what was opened
                    job.cancel()  # not started yet: it never runs
                    job.add_done_callback(self._abandon)
                    admission.add_done_callback(_retrieved)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:
            if isinstance(exc, SpanwarmError):
                logger.info("refused a request: %s", exc)
            await self._refuse(context, exc)
            return
        self.streams += 1
        self.idle.clear()
        try:
            async for message in self._serve(live):
                yield message
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:
            await self._refuse(context, exc)
        finally:
            self.node.release(live)
            self.streams -= 1
            if not self.streams:
                self.idle.set()
            if live.spans > _LARGE:
                self._trim_soon()

    def _trim_soon(self) -> None:
        """Collect and trim the heap once this request's frame has let go of it (one trim
        pending at a time; off the loop: it takes tens of milliseconds)."""
        if not self._trim_pending:
            self._trim_pending = True
            asyncio.get_running_loop().call_later(0.5, self._trim)

    def _trim(self) -> None:
        self._trim_pending = False
        with contextlib.suppress(RuntimeError):  # the pool has shut down: we are exiting
            self.node.admission_pool.submit(_trim_heap, collect=True)

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
        _log_decisions(live, plans, self.config.seek_cost)
        yield warmer_pb2.WarmEvent(
            plan=_message(
                warmer_pb2.Plan,
                {
                    "request_id": live.id,
                    "request_bytes": live.nbytes,
                    "seek_cost_bytes": self.config.seek_cost,
                    "files": [_file_plan(p.to_json()) for p in plans],
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

    def _abandon(self, job: concurrent.futures.Future[Request]) -> None:
        """An admission nobody will use: give its files back once it is done (this runs
        in the admission thread, or here if it is done already; the file table locks)."""
        if not job.cancelled() and job.exception() is None:
            for file in job.result().acquired:
                self.node.files.release(file)

    def _admit(self, data: bytes) -> Request:
        request = _decode(warmer_pb2.WarmRequest, data)
        admitted = admit(request, self.node.files, self.config)
        try:
            live = Request(admitted, self.node.chunk)
        except BaseException:  # MemoryError, a bug: the files go back all the same
            for file in admitted.files:
                self.node.files.release(file)
            raise
        finally:
            if admitted.spans and sum(len(t) for t in admitted.spans.values()) > _LARGE:
                _trim_heap(collect=False)  # the decoding and validation temporaries
        return live

    async def Consumed(self, data: bytes, context: grpc.aio.ServicerContext) -> Any:
        return await self._unary(context, self._consumed, data, context)

    async def _consumed(self, data: bytes, context: grpc.aio.ServicerContext) -> Any:
        if len(data) > _DECODE_INLINE:  # a huge report: decode it off the loop
            request_id, groups = await asyncio.get_running_loop().run_in_executor(
                self.node.admission_pool, _decode_consumed, data
            )
        else:
            request_id, groups = _decode_consumed(data)
        if not self.node.consumed(request_id, groups):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no live request {request_id}")
        return warmer_pb2.ConsumedReply()

    async def Status(self, data: bytes, context: grpc.aio.ServicerContext) -> Any:
        return await self._unary(context, self._status, data)

    async def _status(self, data: bytes) -> Any:
        _decode(warmer_pb2.StatusRequest, data)
        status = self.node.status()
        return _message(
            warmer_pb2.StatusReply,
            {
                **status,
                "version": __version__,
                "ranks": [_message(warmer_pb2.RankStatus, r) for r in status["ranks"]],
                "files": [_file_plan(f) for f in status["files"]],
            },
        )

    async def _unary(
        self,
        context: grpc.aio.ServicerContext,
        handler: Callable[..., Coroutine[Any, Any, Any]],
        *args: Any,
    ) -> Any:
        try:
            return await handler(*args)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:
            await self._refuse(context, exc)


async def _first(*waits: Coroutine[Any, Any, Any]) -> None:
    """Return when the first of these completes; cancel the others."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()


def _log_decisions(live: Request, plans: list[FilePlan], seek_cost: int) -> None:
    """One line per request: what the node plan does with its files, and why."""
    whole = [p for p in plans if p.decision == "whole"]
    logger.info(
        "job %s rank %d: %d tensors, %d bytes in %d files; node plan: %d files whole, %d as "
        "spans, %d bytes to read (seek cost %d)",
        live.job,
        live.rank,
        len(live.groups),
        live.nbytes,
        len(plans),
        len(whole),
        len(plans) - len(whole),
        sum(p.warm_bytes for p in plans),
        seek_cost,
        extra={
            "fields": {
                "job": live.job,
                "rank": live.rank,
                "files": [
                    {**p.to_json(), "whole_cost_bytes": p.size_bytes + seek_cost} for p in plans
                ],
            }
        },
    )


def _retrieved(future: asyncio.Future[Any]) -> None:
    """Mark an abandoned future's outcome as seen (asyncio would log it as never retrieved)."""
    if not future.cancelled():
        future.exception()


def _trim_heap(*, collect: bool) -> None:
    """Give the memory of a large request back to the system: glibc keeps freed heap
    memory otherwise (a 1M-span request would leave ~200 MB of RSS behind), and a cycle
    waits for the collector. Runs in a worker thread."""
    if collect:
        gc.collect()
    if _malloc_trim is not None:
        _malloc_trim(0)


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
