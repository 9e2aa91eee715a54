"""The gRPC servicer: translates between protobuf messages and the node, nothing more."""

from __future__ import annotations

import asyncio
import ctypes
import logging
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import grpc

from spanwarm import __version__
from spanwarm.costmodel import FilePlan
from spanwarm.daemon.admission import admit
from spanwarm.daemon.config import DaemonConfig
from spanwarm.daemon.node import Node
from spanwarm.daemon.request import FAILED, READY, Event, Request
from spanwarm.errors import SpanwarmError
from spanwarm.rpc.v1 import warmer_pb2, warmer_pb2_grpc

__all__ = ["WarmerService"]

try:
    _malloc_trim: Any = ctypes.CDLL(None).malloc_trim  # glibc only
except AttributeError:
    _malloc_trim = None

logger = logging.getLogger("spanwarm.daemon")


_PLAN_FIELDS = tuple(warmer_pb2.FilePlan.DESCRIPTOR.fields_by_name)


def _file_plan(fields: dict[str, Any]) -> Any:
    return warmer_pb2.FilePlan(**{k: v for k, v in fields.items() if k in _PLAN_FIELDS})


class WarmerService(warmer_pb2_grpc.WarmerServicer):  # type: ignore[misc]
    def __init__(self, node: Node, config: DaemonConfig) -> None:
        self.node = node
        self.config = config
        self.draining = False
        self.stopping = asyncio.Event()
        self.streams = 0
        self.idle = asyncio.Event()
        self.idle.set()

    async def Warm(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the daemon is shutting down")
        # stat/open may block on a network mount, and 1M spans take a while to index.
        admission = asyncio.get_running_loop().run_in_executor(None, self._admit, request)
        try:
            live = await asyncio.shield(admission)
        except asyncio.CancelledError:  # the client left while we admitted: give files back
            admission.add_done_callback(self._abandon)
            raise
        except SpanwarmError as exc:
            logger.info("refused a request from job %r rank %d: %s", request.job, request.rank, exc)
            self.node.metrics.errors.labels(exc.grpc_code).inc()
            await context.abort(grpc.StatusCode[exc.grpc_code], str(exc))
        self.node.register(live)
        _log_decisions(live, self.node.plan_of(live), self.config.seek_cost)
        self.streams += 1
        self.idle.clear()
        try:
            yield warmer_pb2.WarmEvent(
                plan=warmer_pb2.Plan(
                    request_id=live.id,
                    request_bytes=live.nbytes,
                    seek_cost_bytes=self.config.seek_cost,
                    files=[_file_plan(p.to_json()) for p in self.node.plan_of(live)],
                )
            )
            while True:
                async for message in _drain(live):
                    yield message
                    if message.HasField("done"):
                        # Everything is warm; the stream stays open while the rank holds
                        # warmed bytes it has not reported read (they count against the
                        # budget, and --hold keeps them mapped), or until shutdown.
                        await _first(live.unheld.wait(), self.stopping.wait())
                        return
        finally:
            self.node.release(live)
            self.streams -= 1
            if not self.streams:
                self.idle.set()

    def _abandon(self, admission: asyncio.Future[Request]) -> None:
        if not admission.cancelled() and admission.exception() is None:
            for file in admission.result().acquired:
                self.node.files.release(file)

    def _admit(self, request: Any) -> Request:
        live = Request(admit(request, self.node.files, self.config), self.node.chunk)
        _trim_heap()
        return live

    async def Consumed(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        if not self.node.consumed(request.request_id, request.groups):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no live request {request.request_id}")
        return warmer_pb2.ConsumedReply()

    async def Status(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        status = self.node.status()
        return warmer_pb2.StatusReply(
            version=__version__,
            **{
                **status,
                "ranks": [warmer_pb2.RankStatus(**r) for r in status["ranks"]],
                "files": [_file_plan(f) for f in status["files"]],
            },
        )


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


def _trim_heap() -> None:
    """Give the temporaries of a large request back to the system: glibc keeps freed
    heap memory otherwise, and a 1M-span request would leave ~200 MB of RSS behind."""
    if _malloc_trim is not None:
        _malloc_trim(0)


async def _drain(live: Request) -> AsyncIterator[Any]:
    """Wait for the next event, then send it with every event already queued behind it:
    ready groups coalesce into one message."""
    events = [await live.events.get()]
    while not live.events.empty():
        events.append(live.events.get_nowait())
    ready = [g for e in events if e.kind == "ready" for g in e.groups]
    if ready:
        yield warmer_pb2.WarmEvent(ready=warmer_pb2.Ready(groups=ready))
    for event in events:
        if event.kind == "failed":
            yield _failed(event)
    for event in events:
        if event.kind == "done":
            yield warmer_pb2.WarmEvent(
                done=warmer_pb2.Done(
                    ready=int((live.state == READY).sum()), failed=int((live.state == FAILED).sum())
                )
            )


def _failed(event: Event) -> Any:
    return warmer_pb2.WarmEvent(
        failed=warmer_pb2.Failed(groups=list(event.groups), code=event.code, reason=event.reason)
    )
