"""The price of one seek, measured: the time of a seek times one stream's sequential rate.

The cost model prices a seek as ``S`` bytes: what a sequential read gets through in the
time one seek costs (docs/planning.md). So it is two measurements on cold data of one
file, both through a single descriptor (one stream) with ``POSIX_FADV_RANDOM``, ``pread``
in pieces of the daemon's chunk size:

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

Used by ``spanwarm calibrate`` (the whole file evicted first) and by the daemon's probe
(windows found cold, and a request arriving stops it: ``busy``).
"""

from __future__ import annotations

import errno
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from spanwarm.residency import PAGE, resident_bytes, resident_pages

__all__ = [
    "MIN_FILE_BYTES",
    "MeasureStopped",
    "SeekCost",
    "SeekPlan",
    "measure_seek_cost",
    "plan_seek_measurement",
]

SLOT = 4 << 20  # windows and seek places are whole slots: between two seeks, one slot
SHORT_BYTES = 2 * SLOT  # the short contiguous read
LONG_BYTES = 6 * SLOT  # the long one: 16 MiB more, at the sequential rate
MIN_SEEKS = 8
MAX_SEEKS = 64
SEEK_SECONDS = 0.5  # enough seeks to outweigh timer and scheduling noise, when fast
MIN_FILE_BYTES = SHORT_BYTES + LONG_BYTES + (MIN_SEEKS + 2) * SLOT  # and a slot between
MAX_CHECKED = 1024  # slots looked at, from the end (4 GiB): a huge file costs no more
CHUNK = 8 << 20  # reads of the daemon's default chunk size
MAX_SEEK_COST = 1 << 30  # past this a figure is a damaged measurement, not a mount


class MeasureStopped(RuntimeError):
    """The file cannot be measured (``retry`` False), or ``busy()`` said to stop
    (``retry`` True)."""

    def __init__(self, reason: str, *, retry: bool = False) -> None:
        super().__init__(reason)
        self.retry = retry


@dataclass(frozen=True)
class SeekPlan:
    """Where to read: the two contiguous windows, and the pages to seek to."""

    short_at: int
    long_at: int
    seeks: tuple[int, ...]


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


def plan_seek_measurement(
    fd: int, size: int, *, busy: Callable[[], bool] = lambda: False
) -> SeekPlan:
    """Cold, allocated places in the open file ``fd`` of ``size`` bytes, from the end back
    (a load reads from the front): two windows, then up to ``MAX_SEEKS`` pages one slot
    apart. At most ``MAX_CHECKED`` slots are looked at, whatever the file's size. Raises
    :class:`MeasureStopped` when there are too few, or when ``busy()`` says so."""
    if os.fstat(fd).st_blocks * 512 < MIN_FILE_BYTES:  # mostly hole: reads cost no I/O
        raise MeasureStopped(f"fewer than {MIN_FILE_BYTES} bytes allocated")
    slots = range((size // SLOT - 1) * SLOT, -1, -SLOT)[:MAX_CHECKED]
    if not slots:
        raise MeasureStopped("smaller than one slot")
    # One mincore pass over what the search may look at (windows reach past their slot),
    # not one per place tried: a file the load left resident is searched in milliseconds.
    # Element i: how many of the first i pages from the last slot on are resident.
    bits = resident_pages(fd, slots[-1], size - slots[-1])
    resident = np.concatenate(([0], np.cumsum(bits, dtype=np.int64)))
    taken: list[tuple[int, int]] = []

    def usable(start: int, length: int) -> bool:
        # One slot clear of everything taken: no read continues near where another ended.
        clear = all(start + length + SLOT <= a or start >= b + SLOT for a, b in taken)
        if not clear or start + length > size:
            return False
        first, last = (start - slots[-1]) // PAGE, (start + length - slots[-1] - 1) // PAGE
        return resident[last + 1] == resident[first] and _all_data(fd, start, start + length)

    seeks: list[int] = []
    for start in slots:
        if busy():
            raise MeasureStopped("a request arrived", retry=True)
        want = (LONG_BYTES, SHORT_BYTES)[len(taken)] if len(taken) < 2 else PAGE
        if usable(start, want):
            if want == PAGE:
                seeks.append(start)
                if len(seeks) == MAX_SEEKS:
                    break
            else:
                taken.append((start, start + want))
    if len(taken) < 2 or len(seeks) < MIN_SEEKS:
        raise MeasureStopped(
            f"{len(taken)} cold windows and {len(seeks)} cold places to seek to in the last "
            f"{MAX_CHECKED} slots; 2 and {MIN_SEEKS} needed"
        )
    return SeekPlan(short_at=taken[1][0], long_at=taken[0][0], seeks=tuple(seeks))


def _all_data(fd: int, start: int, stop: int) -> bool:
    """No hole in ``[start, stop)``: reads there reach the storage."""
    try:
        data = os.lseek(fd, start, os.SEEK_DATA)
        return data == start and os.lseek(fd, start, os.SEEK_HOLE) >= stop
    except OSError as exc:  # ENXIO: nothing but hole from here on
        # Anything else: no SEEK_HOLE here (some FUSE mounts), so the file is all data.
        return exc.errno != errno.ENXIO


def measure_seek_cost(
    fd: int,
    plan: SeekPlan,
    *,
    busy: Callable[[], bool] = lambda: False,
    chunk_bytes: int = CHUNK,
    read: list[tuple[int, int]] | None = None,
) -> SeekCost:
    """Read what ``plan`` names through ``fd`` (one stream; the caller sets
    ``POSIX_FADV_RANDOM``) and price a seek. Each place is checked cold again just before
    it is read: a window found resident stops the measurement, a seek place is passed
    over (someone read it meanwhile: it would time memory). ``busy()`` is asked before
    every read; when it says so, :class:`MeasureStopped` (``retry``) ends the measurement.
    What was read is appended to ``read`` as it goes (for dropping it afterwards)."""
    done = [] if read is None else read

    def timed(offset: int, length: int) -> float:
        if busy():
            raise MeasureStopped("a request arrived", retry=True)
        done.append((offset, offset + length))
        return _read(fd, offset, length, chunk_bytes, busy)

    for at, length in ((plan.long_at, LONG_BYTES), (plan.short_at, SHORT_BYTES)):
        if resident_bytes(fd, at, length):
            raise MeasureStopped(f"the window at {at} was read by someone else meanwhile")
    long_s = timed(plan.long_at, LONG_BYTES)
    short_s = timed(plan.short_at, SHORT_BYTES)
    extra_s = long_s - short_s
    # The difference cancels the first request's latency; noise can make it useless.
    rate = (LONG_BYTES - SHORT_BYTES) / extra_s if extra_s > 0 else LONG_BYTES / long_s
    times: list[float] = []
    for at in plan.seeks:
        if resident_bytes(fd, at, PAGE):
            continue
        times.append(timed(at, PAGE))
        if len(times) >= MIN_SEEKS and sum(times) >= SEEK_SECONDS:
            break
    if len(times) < MIN_SEEKS:
        raise MeasureStopped(f"{len(times)} places to seek to stayed cold, {MIN_SEEKS} needed")
    # The median: one seek that waited on something else says nothing of the storage.
    seek_s = max(0.0, statistics.median(times) - PAGE / rate)
    seek_cost = min(MAX_SEEK_COST, int(seek_s * rate))
    return SeekCost(seek_cost, seek_s, rate, len(times), LONG_BYTES / long_s)


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
