"""Giving a large call's memory back, built alone: a real event loop and thread pool,
and a trim that counts itself."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable

from spanwarm.daemon.heap import HeapTrimmer, forget_frames, trim_heap


def _raise_chained() -> BaseException:
    try:
        try:
            raise KeyError("inner")
        except KeyError as inner:
            raise ValueError("outer") from inner
    except ValueError as exc:
        return exc


def test_forget_frames_drops_every_traceback_in_the_chain() -> None:
    exc = _raise_chained()
    assert exc.__traceback__ is not None
    assert exc.__cause__ is not None
    cause: BaseException = exc.__cause__
    forget_frames(exc)
    left: list[object] = [exc.__traceback__, cause.__traceback__]
    assert left == [None, None]
    assert str(exc) == "outer"


def test_trim_heap_runs() -> None:
    trim_heap(collect=True)
    trim_heap(collect=False)


async def _until(done: Callable[[], bool], seconds: float = 30.0) -> None:
    """Wait for ``done`` (a loaded machine may be slow), then a moment more for extras."""
    for _ in range(int(seconds / 0.01)):
        if done():
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)


def test_calls_ending_while_a_trim_is_pending_get_one_more_trim_not_one_each() -> None:
    trims: list[str] = []

    def trim() -> None:
        trims.append(threading.current_thread().name)

    async def main(pool: concurrent.futures.Executor) -> None:
        trimmer = HeapTrimmer(pool, trim=trim, delay=0.01, again_after=1.0)
        trimmer.soon()
        trimmer.soon()  # pending: one more after it
        trimmer.soon()  # still the same one more
        await _until(lambda: len(trims) >= 2)
        assert len(trims) == 2
        trimmer.after_call()  # now, and again a while later
        await _until(lambda: len(trims) >= 4)
        assert len(trims) == 4

    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="trim") as pool:
        asyncio.run(main(pool))
    assert all(name.startswith("trim") for name in trims)  # off the event loop


def test_no_trim_without_a_loop_or_once_the_pool_is_gone() -> None:
    trims: list[int] = []
    pool = concurrent.futures.ThreadPoolExecutor(1)
    trimmer = HeapTrimmer(pool, trim=lambda: trims.append(1), delay=0.01)
    trimmer.soon()  # no running loop: nothing to do
    pool.shutdown()

    async def main() -> None:
        trimmer.soon()
        await asyncio.sleep(0.1)
        trimmer.soon()  # the shut-down pool refused the last one: not stuck pending
        await asyncio.sleep(0.1)

    asyncio.run(main())
    assert trims == []
