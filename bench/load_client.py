"""One rank of the load benchmark (bench/bench_load.py): a process that imports only the
client side of spanwarm (no torch).

    python bench/load_client.py --socket S --rank R --spans N --files A,B,C,D [--job J]

Builds its spans: N spans of 4-64 KiB, 10 per tensor, over the shared files in read
order. Every tensor has 16 candidate spans common to all ranks and each rank takes 10 of
them, so ranks overlap. Prints ``{"event": "built"}``, waits for a line on stdin (the start
barrier), sends one request and, as tensors are reported ready, checks with mincore on its
own descriptors that their bytes are resident right then. Once all are ready (or failed)
it reports every tensor consumed, so the daemon ends the stream, and waits for the end.

Prints JSON lines on stdout: ``{"event": "plan", "t": T}`` when the plan arrives, then one
``{"event": "result", ...}`` (for tensors found not resident: when, and which pages).
Times are ``time.monotonic()``, which is system-wide on Linux, so comparable across
processes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import numpy as np

from spanwarm.client import Client, TensorSpans
from spanwarm.pagecache.memory_map import mapped, mincore
from spanwarm.pagecache.residency import PAGE, resident_bytes

KiB = 2**10
SPANS_PER_TENSOR = 10
SLOTS = 16  # candidate spans per tensor, shared by every rank
WINDOW = 200  # pending tensors (in read order) looked at on each wake-up
DETAIL_TENSORS, DETAIL_PAGES = 200, 256  # caps on the missing pages reported


def rank_spans(paths: list[str], sizes: list[int], rank: int, spans: int) -> list[TensorSpans]:
    """This rank's spans, tensor by tensor in read order (files in turn, offsets rising)."""
    tensors = max(1, spans // SPANS_PER_TENSOR)
    per_file = -(-tensors // len(paths))
    out: list[TensorSpans] = []
    for k in range(tensors):
        f = k // per_file
        region = sizes[f] // per_file
        slot = region // SLOTS
        base = (k % per_file) * region
        shared = np.random.default_rng([7, k])  # the same candidates for every rank
        lengths = shared.integers(4 * KiB, min(64 * KiB, slot) + 1, SLOTS)
        starts = shared.integers(0, slot - lengths + 1)
        mine = np.sort(np.random.default_rng([rank, k]).choice(SLOTS, SPANS_PER_TENSOR, False))
        for j in mine.tolist():
            length = int(lengths[j])
            offset = base + j * slot + int(starts[j])
            out.append(TensorSpans(f"t{k}", paths[f], offset, length, length, 1))
    return out


def missing_bytes(pieces: list[tuple[int, int, int]]) -> int:
    """Bytes of these (fd, offset, length) pieces that are not in the page cache now."""
    return sum(length - resident_bytes(fd, offset, length) for fd, offset, length in pieces)


def missing_pages(pieces: list[tuple[int, int, int]], index: dict[int, int]) -> list[list[int]]:
    """[file index, page] of every page of these (fd, offset, length) pieces not resident
    now (at most DETAIL_PAGES)."""
    out: list[list[int]] = []
    for fd, offset, length in pieces:
        first, last = offset // PAGE, (offset + length - 1) // PAGE
        with mapped(fd, first * PAGE, (last - first + 1) * PAGE) as addr:
            bits = np.frombuffer(mincore(addr, (last - first + 1) * PAGE), dtype=np.uint8) & 1
        out += [[index[fd], first + int(p)] for p in np.flatnonzero(bits == 0)]
    return out[:DETAIL_PAGES]


def emit(record: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--socket", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--spans", type=int, default=10_000)
    parser.add_argument("--files", required=True, help="comma-separated shared files")
    parser.add_argument("--job", default="bench-load")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds for everything")
    parser.add_argument(
        "--stall-timeout", type=float, default=300.0, help="the client's stall watchdog (s)"
    )
    args = parser.parse_args()

    paths = [os.path.abspath(p) for p in args.files.split(",")]
    fds = {p: os.open(p, os.O_RDONLY | os.O_CLOEXEC) for p in paths}
    sizes = [os.fstat(fds[p]).st_size for p in paths]
    spans = rank_spans(paths, sizes, args.rank, args.spans)
    index = {fds[p]: i for i, p in enumerate(paths)}
    pieces: dict[str, list[tuple[int, int, int]]] = {}
    for s in spans:
        pieces.setdefault(s.tensor, []).append((fds[s.path], s.offset, s.length))
    names = list(pieces)
    emit({"event": "built", "spans": len(spans), "tensors": len(names)})

    sys.stdin.readline()  # the barrier: every rank starts together
    client = Client(args.socket, stream_timeout=args.timeout, stall_timeout=args.stall_timeout)
    start = time.monotonic()
    deadline = start + args.timeout
    ticket = client.request(spans, job=args.job, rank=args.rank)
    plan_t: float | None = None
    pending = names
    not_resident: list[tuple[str, float, int]] = []  # (tensor, seconds, bytes missing)
    detail: list[dict[str, Any]] = []  # the pages missing, for bench_load to explain
    checked = 0
    while pending and time.monotonic() < deadline:
        ticket.wait(pending[:1], timeout=0.01 if plan_t is None else 0.05)
        if plan_t is None and (ticket.plan or ticket.finished.is_set()):
            plan_t = time.monotonic()
            emit({"event": "plan", "t": plan_t, "received": bool(ticket.plan)})
        ready_now = [n for n in pending[:WINDOW] if ticket.ready(n)]
        if not ready_now:
            continue
        # wait() takes the ticket's lock: whatever marked these tensors has finished, so
        # ticket.failures is complete for them.
        ticket.wait(ready_now, timeout=0)
        for name in ready_now:
            if name in ticket.failures:
                continue
            checked += 1
            missing = missing_bytes(pieces[name])
            if missing:
                now = time.monotonic()
                not_resident.append((name, now - start, missing))
                if len(detail) < DETAIL_TENSORS:
                    pages = missing_pages(pieces[name], index)
                    detail.append({"tensor": name, "t": now, "pages": pages})
        done = set(ready_now)
        pending = [n for n in pending if n not in done]
    all_ready_t = time.monotonic() if not pending else None
    # Were the tensors found not resident read late (resident now) or dropped (still not)?
    missing_later = [missing_bytes(pieces[name]) for name, _, _ in not_resident]
    ended_early = ticket.finished.is_set()  # the stream ended before we reported anything
    progress = ticket.progress
    ticket.consumed(names)
    ended = ticket.finished.wait(max(1.0, deadline - time.monotonic()))
    end_t = time.monotonic()
    client.close()
    for fd in fds.values():
        os.close(fd)
    emit(
        {
            "event": "result",
            "rank": args.rank,
            "spans": len(spans),
            "tensors": len(names),
            "bytes": sum(s.length * s.count for s in spans),
            "ready": progress.ready,
            "failed": len(ticket.failures),
            "released": progress.failed - len(ticket.failures),
            "timed_out": len(pending),
            "checked": checked,
            "not_resident": len(not_resident),
            "not_resident_first": [
                {"tensor": name, "at_s": round(t, 3), "missing": missing, "missing_later": later}
                for (name, t, missing), later in zip(
                    not_resident[:5], missing_later[:5], strict=True
                )
            ],
            "not_resident_later": sum(1 for later in missing_later if later),
            "not_resident_pages": detail,
            "first_failure": next(iter(ticket.failures.items()), None),
            "ended_early": ended_early,
            "stream_ended": ended,
            "start": start,
            "plan_s": None if plan_t is None else plan_t - start,
            "all_ready_s": None if all_ready_t is None else all_ready_t - start,
            "end_s": end_t - start,
        }
    )


if __name__ == "__main__":
    main()
