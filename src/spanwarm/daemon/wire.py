"""The Warmer service's wire: the daemon's answers as protobuf messages, a refusal's text
as the status message that carries it, and a ``Consumed`` report decoded.

Everything here is a pure function of its arguments: what the node says (its plans, its
events, its status) in, messages out. Integers are saturated to their field's range, so
a total that grew past its field never fails a whole reply, and every text that travels
in a header (a status message, a failure's reason) is ASCII and bounded.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import numpy.typing as npt
from google.protobuf.descriptor import FieldDescriptor

from spanwarm.daemon.request import FAILED, READY, Event, EventKind
from spanwarm.daemon.span_check import decode_message
from spanwarm.errors import CheckpointError, SpanwarmError
from spanwarm.planning.costmodel import FilePlan
from spanwarm.rpc.v1 import warmer_pb2

__all__ = [
    "MAX_DETAILS",
    "PATH_SHOWN",
    "WARMER",
    "decode_consumed",
    "describe",
    "details",
    "event_messages",
    "file_plan",
    "heartbeat",
    "message",
    "plan_event",
    "status_reply",
]

WARMER = warmer_pb2.DESCRIPTOR.services_by_name["Warmer"].full_name
MAX_DETAILS = 1000  # characters of a status message (it travels in a header)
PATH_SHOWN = 400  # characters of a path quoted in a refusal (its head and its tail)

_LIMITS = {
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
}


def message(cls: Any, fields: dict[str, Any]) -> Any:
    """``cls(**fields)``, integers saturated to their field's range: a total that grew
    past 2**64 shows as the largest value instead of failing the whole reply. Keys the
    message lacks are dropped."""
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


def file_plan(fields: dict[str, Any]) -> Any:
    """A ``FilePlan`` message from a plan's JSON form (keys the proto lacks are dropped)."""
    return message(warmer_pb2.FilePlan, fields)


def details(text: str) -> str:
    """A status message that fits the header it travels in: ASCII (gRPC percent-encodes
    every other byte, tripling it: 1,000 emoji would be 12 KB, past a client's 8 KiB
    metadata limit) and at most ``MAX_DETAILS`` characters."""
    text = _ascii(text)
    return text if len(text) <= MAX_DETAILS else text[: MAX_DETAILS - 3] + "..."


def _ascii(text: str) -> str:
    return text.encode("ascii", "backslashreplace").decode("ascii")


def describe(exc: SpanwarmError) -> str:
    """The refusal's message; a caller's long path is shortened in the middle (after
    escaping, which can make a character ten), so the cause and the offset after it
    always fit in the message."""
    if not isinstance(exc, CheckpointError):
        return str(exc)
    path = _ascii(exc.path)
    if len(path) > PATH_SHOWN:
        half = PATH_SHOWN // 2
        path = f"{path[:half]}...{path[-half:]}"
    where = f" (at offset {exc.offset})" if exc.offset is not None else ""
    return f"{path}: {exc.cause}{where}"


def decode_consumed(data: bytes) -> tuple[int, npt.NDArray[np.int64], str]:
    """A ``ConsumedRequest``: its request id, the groups it reports read, its token."""
    request = decode_message(warmer_pb2.ConsumedRequest, data)
    groups = np.fromiter(request.groups, dtype=np.int64, count=len(request.groups))
    return request.request_id, groups, request.token


def heartbeat(bytes_done: int, in_flight: int) -> Any:
    """A heartbeat: the node's bytes read or verified so far, and its operations in flight."""
    return warmer_pb2.WarmEvent(
        heartbeat=message(warmer_pb2.Heartbeat, {"bytes_done": bytes_done, "in_flight": in_flight})
    )


def plan_event(request_id: int, request_bytes: int, plans: list[tuple[FilePlan, float]]) -> Any:
    """A request's first event: the node plan of its files, each with the stream
    throughput learned on its device."""
    return warmer_pb2.WarmEvent(
        plan=message(
            warmer_pb2.Plan,
            {
                "request_id": request_id,
                "request_bytes": request_bytes,
                # Per mount (learned, or --seek-cost): the largest among these files'.
                "seek_cost_bytes": max((p.seek_cost for p, _ in plans), default=0),
                "files": [
                    file_plan({**p.to_json(), "stream_bytes_per_s": rate}) for p, rate in plans
                ],
            },
        )
    )


def event_messages(events: list[Event], state: npt.NDArray[np.int8]) -> list[Any]:
    """The messages for a request's events in order: ready groups coalesce into one
    message, each failure is one, and ``done`` carries the counts of ``state`` (its
    groups' states: ready and failed)."""
    messages = []
    ready = [g for e in events if e.kind == EventKind.READY for g in e.groups]
    if ready:
        messages.append(warmer_pb2.WarmEvent(ready=warmer_pb2.Ready(groups=ready)))
    messages += [_failed(event) for event in events if event.kind == EventKind.FAILED]
    if any(event.kind == EventKind.DONE for event in events):
        messages.append(
            warmer_pb2.WarmEvent(
                done=warmer_pb2.Done(
                    ready=int((state == READY).sum()), failed=int((state == FAILED).sum())
                )
            )
        )
    return messages


def _failed(event: Event) -> Any:
    return warmer_pb2.WarmEvent(
        failed=warmer_pb2.Failed(
            groups=list(event.groups), code=event.code, reason=details(event.reason)
        )
    )


def status_reply(
    status: dict[str, Any],
    *,
    version: str,
    mounts: Iterable[tuple[str, float, int, int, bool]],
    refusals: Iterable[tuple[str, int]],
) -> Any:
    """A ``StatusReply`` from the node's status (:meth:`.node.Node.status`), what it
    learned per mount (name, stream rate, bytes sampled, seek cost, whether a seek probe
    is due) and the refusals by cause: the caller decides which of these it may see."""
    return message(
        warmer_pb2.StatusReply,
        {
            **status,
            "version": version,
            "ranks": [message(warmer_pb2.RankStatus, r) for r in status["ranks"]],
            "files": [file_plan(f) for f in status["files"]],
            "mounts": [
                message(
                    warmer_pb2.MountStatus,
                    {
                        "mount": name,
                        "stream_bytes_per_s": rate,
                        "sampled_bytes": sampled,
                        "seek_cost_bytes": seek_cost,
                        "seek_probe_due": due,
                    },
                )
                for name, rate, sampled, seek_cost, due in mounts
            ],
            "refusals": [
                warmer_pb2.RefusalCount(cause=cause, count=count) for cause, count in refusals
            ],
        },
    )
