"""Readiness: when a request's cell is warm for it, and what its tensor groups become.

A request's cell is *satisfied* when pieces of warm operations completed after the
request arrived cover its need there: the planned bytes between the first and last byte
it names in the cell (its hull). Bytes warmed for one request serve every other one that
arrived before the piece completed, so each byte is read once per node. A group is ready
when all its cells are; it fails, with the errno and the first bad offset, when a byte
of it is on a page the storage failed, and the request is done once no group is pending.
"""

from __future__ import annotations

from spanwarm.daemon.cells import Cell
from spanwarm.daemon.files import OpenFile
from spanwarm.daemon.ranges import Range, clip, since, subtract
from spanwarm.daemon.request import FAILED, PENDING, READY, CellKey, Event, EventKind, Request
from spanwarm.pagecache.warm_engine import BadRange

__all__ = ["fail_bad_pages", "fail_cell_groups", "finish_if_resolved", "mark_ready", "satisfied"]


def satisfied(request: Request, key: CellKey, cell: Cell[Request], planned: list[Range]) -> bool:
    """Whether warm operations completed since the request arrived cover its need in the
    cell (``planned``: the plan's ranges in the cell). Bytes that failed while it waited
    on the cell are not needed: its groups on them failed then (:func:`fail_bad_pages`); a
    failure from before it waited is not excused, the bytes are read again."""
    lo, hi = request.hull(key)
    need = subtract(clip(planned, lo, hi), since(cell.bad, request.activated))
    return not subtract(need, since(cell.warm, request.arrival))


def mark_ready(request: Request, key: CellKey) -> None:
    """The cell is warm for the request: its groups there have one cell fewer to wait for;
    those with none left are ready (one event)."""
    request.pending.discard(key)
    groups = request.cell_groups(key)
    groups = groups[request.state[groups] == PENDING]
    request.remaining[groups] -= 1
    now_ready = groups[request.remaining[groups] == 0]
    if now_ready.size:  # (else no group changed: its resolution cannot have either)
        request.state[now_ready] = READY
        request.events.put_nowait(Event(EventKind.READY, tuple(now_ready.tolist())))
        finish_if_resolved(request)


def fail_cell_groups(request: Request, key: CellKey, code: str, cause: str) -> bool:
    """Fail the request's pending groups on this cell; the reason names the file as this
    request's caller knows it. Whether any group failed."""
    request.pending.discard(key)
    groups = request.cell_groups(key)
    groups = groups[request.state[groups] == PENDING]
    if groups.size:
        request.state[groups] = FAILED
        reason = f"{request.name_of(key[0])}: {cause}"
        request.events.put_nowait(Event(EventKind.FAILED, tuple(groups.tolist()), code, reason))
    finish_if_resolved(request)
    return bool(groups.size)


def fail_bad_pages(request: Request, file: OpenFile, bad: list[BadRange]) -> int:
    """Fail exactly the request's pending groups with a byte on a bad page: one failed
    event per bad range, naming the errno and where the range starts. The events sent."""
    sent = 0
    for b in bad:
        groups = request.groups_touching(file, b.start, b.stop)
        groups = groups[request.state[groups] == PENDING]
        if not groups.size:
            continue
        request.state[groups] = FAILED
        reason = f"{request.name_of(file)}: {b.cause} (at offset {b.start})"
        request.events.put_nowait(
            Event(EventKind.FAILED, tuple(groups.tolist()), "UNAVAILABLE", reason)
        )
        sent += 1
    finish_if_resolved(request)
    return sent


def finish_if_resolved(request: Request) -> None:
    """Send ``done`` once, when no group is pending."""
    if not request.finished and request.resolved:  # (resolved looks at every group)
        request.finished = True
        request.events.put_nowait(Event(EventKind.DONE))
