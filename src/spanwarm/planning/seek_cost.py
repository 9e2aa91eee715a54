"""The price of one seek, measured: the time of a seek times one stream's sequential rate.

The cost model prices a seek as ``S`` bytes: what a sequential read gets through in the
time one seek costs (docs/planning.md). So it is two measurements on cold data of a
mount's files, each read through a single descriptor (one stream) with
``POSIX_FADV_RANDOM``, ``pread`` in pieces of the daemon's chunk size:

- the sequential rate: a short and a long contiguous read at two places; the difference
  in bytes over the difference in time, so the latency of their first request cancels
  out (what bridging a gap costs per byte);
- the time of one seek: one page read at each of several places 4 MiB apart, far
  enough that no readahead window and no server-side stream joins two of them (an emulated
  or real network mount reads on without a new request's latency when the next request
  lands a little ahead): the median, less the page's own transfer time.

Neither is what evenly spaced small spans give: 16 KiB every 128 KiB is one stream to
such a mount, and prices a seek at a few dozen KiB where the mount really charges its
full latency for every jump past its window.

The places may lie in several files of one mount (a checkpoint of many small shards, a
DCP directory written by many ranks): the windows in the first files with room for them,
24 and 8 MiB where that leaves enough places to seek to, else 12 and 4 MiB; the seeks in
whatever slots are left.

Used by ``spanwarm calibrate`` (one file, evicted first) and by the daemon's probe
(places found cold, and a request arriving stops it: ``busy``).
"""

from __future__ import annotations

import errno
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from spanwarm.pagecache.residency import PAGE, resident_bytes, resident_pages

__all__ = [
    "MIN_FILE_BYTES",
    "MIN_PLACE_BYTES",
    "FileFailed",
    "MeasureStopped",
    "Place",
    "SeekCost",
    "SeekPlan",
    "measure_seek_cost",
    "plan_seek_measurement",
]

SLOT = 4 << 20  # windows and seek places are whole slots: between two seeks, one slot
# The (long, short) windows, the first pair there is room for: the long one reads
# 16 MiB (8 MiB) more than the short one, at the sequential rate.
WINDOWS = ((6 * SLOT, 2 * SLOT), (3 * SLOT, SLOT))
LONG_BYTES, SHORT_BYTES = WINDOWS[0]
MIN_SEEKS = 8
MAX_SEEKS = 64
SEEK_SECONDS = 0.5  # enough seeks to outweigh timer and scheduling noise, when fast
# One file that holds everything at the full geometry, a slot between each place.
MIN_FILE_BYTES = SHORT_BYTES + LONG_BYTES + (MIN_SEEKS + 2) * SLOT
MIN_PLACE_BYTES = 2 * SLOT  # a smaller file holds at most one place: not worth a look
MAX_CHECKED = 1024  # slots looked at in all (4 GiB), from each file's end: huge files cost no more
CHUNK = 8 << 20  # reads of the daemon's default chunk size
MAX_SEEK_COST = 1 << 30  # past this a figure is a damaged measurement, not a mount


class MeasureStopped(RuntimeError):
    """The files cannot be measured (``retry`` False), or ``busy()`` said to stop
    (``retry`` True)."""

    def __init__(self, reason: str, *, retry: bool = False) -> None:
        super().__init__(reason)
        self.retry = retry


class FileFailed(RuntimeError):
    """Looking at or reading file ``index`` failed: that file, not the others, is to
    blame (``__cause__`` says how)."""

    def __init__(self, index: int, offset: int, exc: Exception) -> None:
        super().__init__(f"file {index} at offset {offset}: {exc}")
        self.index, self.offset, self.reason = index, offset, exc


@dataclass(frozen=True)
class Place:
    file: int
    """Index into the files planned on."""
    offset: int


@dataclass(frozen=True)
class SeekPlan:
    """Where to read: the two contiguous windows, and the pages to seek to."""

    long: Place
    short: Place
    long_bytes: int
    short_bytes: int
    seeks: tuple[Place, ...]


@dataclass(frozen=True)
class SeekCost:
    seek_cost: int
    """Bytes one seek costs: ``seek_s`` x ``stream_bytes_per_s``."""
    seek_s: float
    stream_bytes_per_s: float
    seeks: int
    window_bytes_per_s: float
    """The long window over its whole time, the first request's latency and all: below
    ``stream_bytes_per_s``, but never inflated by noise in a difference of two timings."""


class _ColdFile:
    """Where in one file a place may go: cold, allocated, a slot clear of the places
    taken there already. One mincore pass over the slots looked at (windows reach past
    their slot), and at most one SEEK_DATA/SEEK_HOLE pair per slot, whatever is tried
    there: a file the load left resident, or a huge sparse one, is searched in
    milliseconds."""

    def __init__(self, fd: int, size: int, budget: int) -> None:
        self.fd, self.size = fd, size
        self.taken: list[tuple[int, int]] = []
        self._data: dict[int, bool] = {}  # slot start: no hole in it
        self.slots: Sequence[int] = ()
        if budget <= 0 or size < MIN_PLACE_BYTES:
            return
        if os.fstat(fd).st_blocks * 512 < MIN_PLACE_BYTES:  # mostly hole: reads cost no I/O
            return
        self.slots = range((size // SLOT - 1) * SLOT, -1, -SLOT)[:budget]
        bits = resident_pages(fd, self.slots[-1], size - self.slots[-1])
        # Element i: how many of the first i pages from the last slot on are resident.
        self._resident = np.concatenate(([0], np.cumsum(bits, dtype=np.int64)))

    def usable(self, start: int, length: int) -> bool:
        # One slot clear of everything taken: no read continues near where another ended.
        clear = all(start + length + SLOT <= a or start >= b + SLOT for a, b in self.taken)
        if not clear or start + length > self.size:
            return False
        base = self.slots[-1]
        first, last = (start - base) // PAGE, (start + length - base - 1) // PAGE
        if self._resident[last + 1] != self._resident[first]:
            return False
        return all(self._all_data(slot) for slot in range(start, start + length, SLOT))

    def _all_data(self, slot: int) -> bool:
        if slot not in self._data:
            self._data[slot] = _all_data(self.fd, slot, min(slot + SLOT, self.size))
        return self._data[slot]


def plan_seek_measurement(
    files: Sequence[tuple[int, int]],
    *,
    busy: Callable[[], bool] = lambda: False,
    touch: Callable[[int], object] = lambda index: None,
) -> SeekPlan:
    """Cold, allocated places in the open files ``files`` (descriptor, size) of one mount:
    two windows, then up to ``MAX_SEEKS`` pages one slot apart, each file searched from
    the end back, ``MAX_CHECKED`` slots in all (the larger files first). The larger
    windows where they leave enough places to seek to, else the smaller. Raises
    :class:`MeasureStopped` when there are too few, or when ``busy()`` says so;
    :class:`FileFailed` when a file cannot be looked at. ``touch(index)`` is called
    before each file is looked at (to know which one a stuck call is in)."""
    cold: list[_ColdFile] = []
    budget = MAX_CHECKED
    for index, (fd, size) in enumerate(files):
        if busy():
            raise MeasureStopped("a request arrived", retry=True)
        touch(index)
        try:
            cold.append(_ColdFile(fd, size, budget))
        except OSError as exc:
            raise FileFailed(index, 0, exc) from exc
        budget -= len(cold[-1].slots)
    found = ""
    for long_bytes, short_bytes in WINDOWS:
        for item in cold:
            item.taken.clear()
        windows = [_take(cold, n, busy, touch) for n in (long_bytes, short_bytes)]
        seeks: list[Place] = []
        for index, item in enumerate(cold):
            for start in item.slots:
                if len(seeks) == MAX_SEEKS:
                    break
                if _usable(cold, index, start, PAGE, busy, touch):  # a slot past the last
                    seeks.append(Place(index, start))
        long, short = windows
        if long is not None and short is not None and len(seeks) >= MIN_SEEKS:
            return SeekPlan(long, short, long_bytes, short_bytes, tuple(seeks))
        found = f"{2 - windows.count(None)} cold windows and {len(seeks)} cold places to seek to"
    raise MeasureStopped(f"{found} in {len(files)} files; 2 and {MIN_SEEKS} needed")


def _usable(
    cold: Sequence[_ColdFile],
    index: int,
    start: int,
    length: int,
    busy: Callable[[], bool],
    touch: Callable[[int], object],
) -> bool:
    if busy():
        raise MeasureStopped("a request arrived", retry=True)
    touch(index)
    try:
        return cold[index].usable(start, length)
    except OSError as exc:  # fstat or SEEK_DATA of a failing file
        raise FileFailed(index, start, exc) from exc


def _take(
    cold: Sequence[_ColdFile],
    length: int,
    busy: Callable[[], bool],
    touch: Callable[[int], object],
) -> Place | None:
    """A place of ``length`` bytes in the first file that has one."""
    for index, item in enumerate(cold):
        for start in item.slots:
            if _usable(cold, index, start, length, busy, touch):
                item.taken.append((start, start + length))
                return Place(index, start)
    return None


def _all_data(fd: int, start: int, stop: int) -> bool:
    """No hole in ``[start, stop)``: reads there reach the storage."""
    try:
        data = os.lseek(fd, start, os.SEEK_DATA)
        return data == start and os.lseek(fd, start, os.SEEK_HOLE) >= stop
    except OSError as exc:  # ENXIO: nothing but hole from here on
        # Anything else: no SEEK_HOLE here (some FUSE mounts), so the file is all data.
        return exc.errno != errno.ENXIO


def measure_seek_cost(
    fds: Sequence[int],
    plan: SeekPlan,
    *,
    busy: Callable[[], bool] = lambda: False,
    chunk_bytes: int = CHUNK,
    read: list[tuple[int, int, int]] | None = None,
    touch: Callable[[int], object] = lambda index: None,
    forget: Callable[[int, int, int], object] = lambda index, start, stop: None,
) -> SeekCost:
    """Read what ``plan`` names through ``fds`` (one stream each, the files it was planned
    on; the caller sets ``POSIX_FADV_RANDOM``) and price a seek. Each place is checked
    cold again just before it is read: a seek place found resident is passed over
    (someone read it meanwhile: it would time memory). ``busy()`` is asked before every
    read; when it says so, :class:`MeasureStopped` (``retry``) ends the measurement. What
    was read is appended to ``read`` as (file, start, stop) before it is read, and
    ``forget(file, start, stop)`` is called as soon as the read ends (to drop those pages
    before another process comes to use them); ``touch(index)`` is called before each
    file is looked at (to know which one a stuck call is in). A read that fails, a file
    that ends early or a window found resident raises :class:`FileFailed` for that file."""
    done = [] if read is None else read

    def resident(place: Place, length: int) -> int:
        touch(place.file)
        try:
            return resident_bytes(fds[place.file], place.offset, length)
        except OSError as exc:
            raise FileFailed(place.file, place.offset, exc) from exc

    def timed(place: Place, length: int) -> float:
        if busy():
            raise MeasureStopped("a request arrived", retry=True)
        touch(place.file)
        done.append((place.file, place.offset, place.offset + length))
        try:
            return _read(fds[place.file], place.offset, length, chunk_bytes, busy)
        except OSError as exc:
            raise FileFailed(place.file, place.offset, exc) from exc
        except MeasureStopped as exc:
            if exc.retry:
                raise
            raise FileFailed(place.file, place.offset, exc) from exc  # it shrank
        finally:
            forget(place.file, place.offset, place.offset + length)

    for place, length in ((plan.long, plan.long_bytes), (plan.short, plan.short_bytes)):
        if resident(place, length):
            warmed = MeasureStopped("read by someone else since the plan")
            raise FileFailed(place.file, place.offset, warmed)
    long_s = timed(plan.long, plan.long_bytes)
    short_s = timed(plan.short, plan.short_bytes)
    extra_s, extra_bytes = long_s - short_s, plan.long_bytes - plan.short_bytes
    # The difference cancels the first request's latency; noise can make it useless.
    rate = extra_bytes / extra_s if extra_s > 0 else plan.long_bytes / long_s
    times: list[float] = []
    for place in plan.seeks:
        if resident(place, PAGE):
            continue
        times.append(timed(place, PAGE))
        if len(times) >= MIN_SEEKS and sum(times) >= SEEK_SECONDS:
            break
    if len(times) < MIN_SEEKS:
        raise MeasureStopped(f"{len(times)} places to seek to stayed cold, {MIN_SEEKS} needed")
    # The median: one seek that waited on something else says nothing of the storage.
    seek_s = max(0.0, statistics.median(times) - PAGE / rate)
    seek_cost = min(MAX_SEEK_COST, int(seek_s * rate))
    return SeekCost(seek_cost, seek_s, rate, len(times), plan.long_bytes / long_s)


def _read(fd: int, offset: int, length: int, chunk: int, busy: Callable[[], bool]) -> float:
    """Seconds to read ``[offset, offset + length)`` with ``pread``, ``chunk`` at a time
    (``busy()`` asked between chunks)."""
    started = time.perf_counter()
    end = offset + length
    while offset < end:
        got = os.pread(fd, min(chunk, end - offset), offset)
        if not got:
            raise MeasureStopped(f"the file ended at {offset}")
        offset += len(got)
        if offset < end and busy():
            raise MeasureStopped("a request arrived", retry=True)
    return time.perf_counter() - started
