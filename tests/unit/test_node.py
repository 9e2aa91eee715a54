"""The node's core on the in-memory page cache: requests registered, planned, warmed once
per node, made ready and failed exactly, with no socket and no daemon around it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np

from spanwarm.checkpoint.spans import SpanTable, StridedSpan
from spanwarm.daemon.admission import AdmittedRequest
from spanwarm.daemon.config import DaemonConfig
from spanwarm.daemon.files import OpenFile
from spanwarm.daemon.node import Node
from spanwarm.daemon.page_cache import MemoryPageCache
from spanwarm.daemon.request import Event, EventKind, Request
from spanwarm.pagecache.residency import PAGE

MiB = 2**20
CHUNK = MiB


def _run(
    tmp_path: Path, case: Callable[[Node, Path], Awaitable[None]], *, workers: int = 4
) -> None:
    """Run ``case`` on a started node of its own, closed after."""
    config = DaemonConfig(
        socket=str(tmp_path / "s.sock"),
        chunk_bytes=CHUNK,
        workers=workers,
        seek_cost=0,  # spans, not whole files: exactly what was asked is read
        state_dir="",
        allow=(str(tmp_path),),
    )

    async def main() -> None:
        node = Node(config, page_cache=MemoryPageCache())
        node.start()
        try:
            await case(node, tmp_path)
        finally:
            await node.close()

    asyncio.run(main())


def _file(node: Node, tmp_path: Path, name: str, size: int) -> OpenFile:
    path = tmp_path / name
    path.write_bytes(b"\0" * size)
    file, _ = node.files.acquire(str(path))
    return file


def _request(node: Node, spans: list[tuple[OpenFile, str, int, int]], job: str = "j") -> Request:
    """One group per span: (file, tensor, offset, length)."""
    files = list(dict.fromkeys(f for f, *_ in spans))
    tables, groups = {}, {}
    for i, file in enumerate(files):
        mine = [(g, off, n) for g, (f, _, off, n) in enumerate(spans) if f is file]
        tables[i] = SpanTable.of([StridedSpan(off, n, n, 1) for _, off, n in mine])
        groups[i] = np.array([g for g, _, _ in mine], dtype=np.int64)
    for file in files:
        file.refs += 1  # the request's own reference (admission takes one per path)
    admitted = AdmittedRequest(
        job=job,
        rank=0,
        files=files,
        names=[f.path for f in files],
        groups=[t for _, t, _, _ in spans],
        spans=tables,
        span_groups=groups,
    )
    return Request(admitted, node.chunk)


async def _events(request: Request) -> list[Event]:
    out = []
    while True:
        event = await asyncio.wait_for(request.events.get(), 10)
        out.append(event)
        if event.kind == EventKind.DONE:
            return out


def _cache(node: Node) -> MemoryPageCache:
    assert isinstance(node.page_cache, MemoryPageCache)
    return node.page_cache


async def _test_a_request_is_warmed_exactly_and_made_ready(node: Node, tmp_path: Path) -> None:
    f = _file(node, tmp_path, "a", 4 * MiB)
    r = _request(node, [(f, "t0", 0, 100_000), (f, "t1", 3 * MiB, 2 * PAGE)])
    await node.register(r)
    events = await _events(r)
    ready = sorted(g for e in events if e.kind == EventKind.READY for g in e.groups)
    assert ready == [0, 1]
    cache = _cache(node)
    read = sorted((s, e) for _, s, e in cache.reads)
    assert read == [(0, 100_000), (3 * MiB, 3 * MiB + 2 * PAGE)]
    status = node.status()
    assert status["bytes_warm"] == status["bytes_planned"] == 100_000 + 2 * PAGE
    node.release(r)
    assert node.status()["files"] == []


async def _test_two_ranks_asking_for_the_same_bytes_read_them_once(
    node: Node, tmp_path: Path
) -> None:
    f = _file(node, tmp_path, "a", 2 * MiB)
    r1 = _request(node, [(f, "t", 0, MiB)])
    r2 = _request(node, [(f, "t", 0, MiB)])
    await asyncio.gather(node.register(r1), node.register(r2))
    await asyncio.gather(_events(r1), _events(r2))
    assert sum(e - s for _, s, e in _cache(node).reads) == MiB
    node.release(r1)
    node.release(r2)


async def _test_a_late_request_is_not_ready_from_bytes_warmed_before_it_came(
    node: Node, tmp_path: Path
) -> None:
    """Its readiness needs reads completed after it arrived, or pages it may trust as
    resident: here the in-memory cache says resident, so no second read."""
    f = _file(node, tmp_path, "a", MiB)
    r1 = _request(node, [(f, "t", 0, MiB)])
    await node.register(r1)
    await _events(r1)
    node.release(r1)
    r2 = _request(node, [(f, "t", 0, MiB)])
    await node.register(r2)
    await _events(r2)
    assert sum(e - s for _, s, e in _cache(node).reads) == MiB  # resident: verified, not read
    _cache(node).evict(f)
    r3 = _request(node, [(f, "t", 0, MiB)])
    await node.register(r3)
    await _events(r3)
    assert sum(e - s for _, s, e in _cache(node).reads) == 2 * MiB  # evicted: read again
    node.release(r2)
    node.release(r3)


async def _test_bad_pages_fail_only_the_tensors_on_them(node: Node, tmp_path: Path) -> None:
    f = _file(node, tmp_path, "a", 2 * MiB)
    _cache(node).bad[f] = [(MiB + PAGE, MiB + 2 * PAGE)]
    r = _request(node, [(f, "good", 0, MiB), (f, "bad", MiB, MiB)])
    await node.register(r)
    events = await _events(r)
    failed = [e for e in events if e.kind == EventKind.FAILED]
    assert [e.groups for e in failed] == [(1,)]
    assert failed[0].code == "UNAVAILABLE"
    assert f"at offset {MiB + PAGE}" in failed[0].reason
    assert f.path in failed[0].reason
    assert [g for e in events if e.kind == EventKind.READY for g in e.groups] == [0]
    node.release(r)


async def _test_a_file_replaced_while_warming_is_aborted_not_ready(
    node: Node, tmp_path: Path
) -> None:
    f = _file(node, tmp_path, "a", 2 * MiB)
    _cache(node).changed.add(f)
    r = _request(node, [(f, "t", 0, 2 * MiB)])
    await node.register(r)
    events = await _events(r)
    assert not any(e.kind == EventKind.READY for e in events)
    failed = [e for e in events if e.kind == EventKind.FAILED]
    assert failed
    assert failed[0].code == "ABORTED"
    node.release(r)


async def _test_a_released_request_gives_back_its_files_and_cells(
    node: Node, tmp_path: Path
) -> None:
    f = _file(node, tmp_path, "a", 2 * MiB)
    gate = asyncio.Event()
    loop = asyncio.get_running_loop()
    started = asyncio.Event()

    def hold(file: object, start: int, stop: int) -> None:
        loop.call_soon_threadsafe(started.set)
        asyncio.run_coroutine_threadsafe(gate.wait(), loop).result(10)

    _cache(node).on_read = hold
    r = _request(node, [(f, "t", 0, 2 * MiB)])
    await node.register(r)
    await asyncio.wait_for(started.wait(), 10)
    node.release(r)
    gate.set()
    for _ in range(100):  # the operation in flight stops at its next piece
        if node.in_flight == 0:
            break
        await asyncio.sleep(0.05)
    assert node.in_flight == 0
    assert len(node.cells) == 0
    assert node.status()["ranks"] == []
    assert node.holds.held_total == 0


def test_a_request_is_warmed_exactly_and_made_ready(tmp_path: Path) -> None:
    _run(tmp_path, _test_a_request_is_warmed_exactly_and_made_ready)


def test_two_ranks_asking_for_the_same_bytes_read_them_once(tmp_path: Path) -> None:
    _run(tmp_path, _test_two_ranks_asking_for_the_same_bytes_read_them_once)


def test_a_late_request_is_not_ready_from_bytes_warmed_before_it_came(tmp_path: Path) -> None:
    _run(tmp_path, _test_a_late_request_is_not_ready_from_bytes_warmed_before_it_came)


def test_bad_pages_fail_only_the_tensors_on_them(tmp_path: Path) -> None:
    _run(tmp_path, _test_bad_pages_fail_only_the_tensors_on_them)


def test_a_file_replaced_while_warming_is_aborted_not_ready(tmp_path: Path) -> None:
    _run(tmp_path, _test_a_file_replaced_while_warming_is_aborted_not_ready)


def test_a_released_request_gives_back_its_files_and_cells(tmp_path: Path) -> None:
    _run(tmp_path, _test_a_released_request_gives_back_its_files_and_cells)


async def _first_tensors_go_first(node: Node, tmp_path: Path) -> None:
    a = _file(node, tmp_path, "a", 8 * MiB)
    b = _file(node, tmp_path, "b", 8 * MiB)
    gate = threading.Event()
    _cache(node).on_read = lambda file, start, stop: gate.wait(10)  # type: ignore[assignment]
    r1 = _request(node, [(a, "r1.t0", 0, MiB), (a, "r1.t1", 4 * MiB, MiB)])
    r2 = _request(node, [(b, "r2.t0", 0, MiB), (b, "r2.t1", 4 * MiB, MiB)])
    await asyncio.gather(node.register(r1), node.register(r2))
    gate.set()
    await asyncio.gather(_events(r1), _events(r2))
    cells = list(dict.fromkeys((f, s // CHUNK) for f, s, _ in _cache(node).reads))
    assert cells == [(a, 0), (b, 0), (a, 4), (b, 4)] or cells == [(b, 0), (a, 0), (b, 4), (a, 4)]
    node.release(r1)
    node.release(r2)


def test_every_rank_s_first_tensor_goes_before_any_second(tmp_path: Path) -> None:
    _run(tmp_path, _first_tensors_go_first, workers=1)
