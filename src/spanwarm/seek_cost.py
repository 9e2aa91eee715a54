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

from spanwarm.residency import PAGE, resident_bytes

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
CHUNK = 8 << 20  # reads of the daemon's default chunk size
MAX_SEEK_COST = 1 << 30  # past this a figure is a damaged measurement, not a mount


class MeasureStopped(Exception):
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

    @property
    def ranges(self) -> list[tuple[int, int]]:
        """Everything the measurement may read (for dropping it again afterwards)."""
        return [
            (self.short_at, self.short_at + SHORT_BYTES),
            (self.long_at, self.long_at + LONG_BYTES),
            *((at, at + PAGE) for at in self.seeks),
        ]


@dataclass(frozen=True)
class SeekCost:
    seek_cost: int
    """Bytes one seek costs: ``seek_s`` x ``stream_bytes_per_s``."""
    seek_s: float
    stream_bytes_per_s: float
    seeks: int


def plan_seek_measurement(fd: int, size: int, *, require_cold: bool = True) -> SeekPlan:
    """Cold, allocated places in the open file ``fd`` of ``size`` bytes, from the end back
    (a load reads from the front): two windows, then up to ``MAX_SEEKS`` pages one slot
    apart. Raises :class:`MeasureStopped` when there are too few."""
    slots = [c * SLOT for c in range(size // SLOT - 1, -1, -1)]  # whole slots, last first
    taken: list[tuple[int, int]] = []

    def usable(start: int, length: int) -> bool:
        # One slot clear of everything taken: no read continues near where another ended.
        clear = all(start + length + SLOT <= a or start >= b + SLOT for a, b in taken)
        cold = not require_cold or resident_bytes(fd, start, length) == 0
        return clear and start + length <= size and cold and _all_data(fd, start, start + length)

    for want in (LONG_BYTES, SHORT_BYTES):
        found = next((c for c in slots if usable(c, want)), None)
        if found is None:
            raise MeasureStopped(f"no cold {want >> 20} MiB window")
        taken.append((found, found + want))
    windows = [a for a, _ in taken]
    seeks = tuple(c for c in slots if usable(c, PAGE))[:MAX_SEEKS]
    if len(seeks) < MIN_SEEKS:
        raise MeasureStopped(f"{len(seeks)} cold places to seek to, {MIN_SEEKS} needed")
    return SeekPlan(short_at=windows[1], long_at=windows[0], seeks=seeks)


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
) -> SeekCost:
    """Read what ``plan`` names through ``fd`` (one stream; the caller sets
    ``POSIX_FADV_RANDOM``) and price a seek. ``busy()`` is asked between reads; when it
    says so, :class:`MeasureStopped` (``retry``) ends the measurement."""
    long_s = _read(fd, plan.long_at, LONG_BYTES, chunk_bytes, busy)
    short_s = _read(fd, plan.short_at, SHORT_BYTES, chunk_bytes, busy)
    extra_s = long_s - short_s
    # The difference cancels the first request's latency; noise can make it useless.
    rate = (LONG_BYTES - SHORT_BYTES) / extra_s if extra_s > 0 else LONG_BYTES / long_s
    times: list[float] = []
    for at in plan.seeks:
        times.append(_read(fd, at, PAGE, chunk_bytes, busy))
        if len(times) >= MIN_SEEKS and sum(times) >= SEEK_SECONDS:
            break
    # The median: one seek that waited on something else says nothing of the storage.
    seek_s = max(0.0, statistics.median(times) - PAGE / rate)
    return SeekCost(min(MAX_SEEK_COST, int(seek_s * rate)), seek_s, rate, len(times))


def _read(fd: int, offset: int, length: int, chunk: int, busy: Callable[[], bool]) -> float:
    """Seconds to read ``[offset, offset + length)`` with ``pread``, ``chunk`` at a time."""
    if busy():
        raise MeasureStopped("a request arrived", retry=True)
    started = time.perf_counter()
    end = offset + length
    while offset < end:
        got = os.pread(fd, min(chunk, end - offset), offset)
        if not got:
            raise MeasureStopped(f"the file ended at {offset}")
        offset += len(got)
    return time.perf_counter() - started
