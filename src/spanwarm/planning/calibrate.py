"""Measure the seek cost of the storage under a file, and where spans stop paying.

The seek cost ``S`` is what a sequential read gets through in the time one seek costs:
:mod:`spanwarm.planning.seek_cost` measures both on the file (one stream's rate from a short and a
long contiguous read, the time of a seek from single pages 4 MiB apart), the file
evicted first. It is the measurement the daemon's probe makes on each mount by itself.

Then, as the seed did, 12.5% of the file is read as spans of one size, for sizes from
small to large, with the page cache evicted before every point, and the whole file for
reference: the break-even span size is where 12.5% as spans stops being slower than
everything. Those reads go through the warm engine as the daemon issues them: fresh
descriptors per operation, ``POSIX_FADV_RANDOM``, the ``read`` method, operations of at
most 8 MiB, with one worker by default. (A fit of their time against the number of spans
does not price a seek: evenly spaced small spans are one stream to a mount that reads on
past small gaps, and the fit then says a few dozen KiB where a real jump costs its full
latency.)
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from spanwarm.pagecache.residency import evict
from spanwarm.pagecache.warm_engine import WarmEngine, WarmMethod
from spanwarm.planning.seek_cost import (
    MIN_FILE_BYTES,
    FileFailed,
    MeasureStopped,
    SeekCost,
    measure_seek_cost,
    plan_seek_measurement,
)

__all__ = ["Calibration", "Point", "calibrate", "measure_seek", "read_ranges", "spans_covering"]

CHUNK = 8 * 2**20
DEFAULT_SIZES = (16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20)


@dataclass(frozen=True)
class Point:
    span_bytes: int
    spans: int
    spans_s: float
    whole_s: float


@dataclass(frozen=True)
class Calibration:
    path: str
    size: int
    fraction: float
    points: tuple[Point, ...]
    seek: SeekCost
    """One seek's time, one stream's rate, and their product (median of the repeats)."""
    breakeven: int | None
    """Smallest span size at which reading the fraction as spans beat reading everything."""

    @property
    def seek_cost(self) -> int:
        """Bytes one seek costs: what ``--seek-cost`` should be on this mount."""
        return self.seek.seek_cost


def spans_covering(size: int, span_bytes: int, fraction: float) -> list[tuple[int, int]]:
    """Spans of ``span_bytes`` covering ``fraction`` of the file, evenly spaced: every gap
    is the same, so every span costs one seek (random placement would put some together)."""
    step = max(span_bytes, int(span_bytes / fraction) // span_bytes * span_bytes)
    return [(start, start + span_bytes) for start in range(0, size - span_bytes + 1, step)]


def _operations(ranges: Sequence[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """Ranges grouped by 8 MiB cell, as the daemon groups its work."""
    ops: dict[int, list[tuple[int, int]]] = {}
    for start, stop in ranges:
        while start < stop:
            end = min(stop, (start // CHUNK + 1) * CHUNK)
            ops.setdefault(start // CHUNK, []).append((start, end))
            start = end
    return list(ops.values())


def read_ranges(path: str, ranges: Sequence[tuple[int, int]], workers: int = 8) -> float:
    """Evict the file, then read ``ranges`` like the daemon; seconds taken."""
    evict(path)
    engine = WarmEngine(WarmMethod.READ, chunk_bytes=CHUNK)

    def operation(group: list[tuple[int, int]]) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            engine.warm(fd, group)
        finally:
            os.close(fd)

    start = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(operation, _operations(ranges)))
    return time.perf_counter() - start


def measure_seek(path: str) -> SeekCost:
    """Evict ``path``, then price one seek on it (:mod:`spanwarm.planning.seek_cost`)."""
    evict(path)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        size = os.fstat(fd).st_size
        return measure_seek_cost([fd], plan_seek_measurement([(fd, size)]), chunk_bytes=CHUNK)
    except FileFailed as exc:
        raise RuntimeError(f"{path} at offset {exc.offset}: {exc.reason}") from exc
    except MeasureStopped as exc:
        raise RuntimeError(f"{path}: {exc}") from exc
    finally:
        os.close(fd)


def calibrate(
    path: str,
    *,
    sizes: Sequence[int] = DEFAULT_SIZES,
    fraction: float = 0.125,
    workers: int = 1,
    repeats: int = 1,
    progress: Callable[[Point], None] | None = None,
) -> Calibration:
    """Price a seek, then measure every span size (paired with a whole-file read)."""
    size = os.stat(path).st_size
    if size < MIN_FILE_BYTES:
        raise ValueError(f"{path}: {size} bytes is too small to calibrate on")
    seeks = sorted((measure_seek(path) for _ in range(repeats)), key=lambda s: s.seek_cost)
    points = []
    for span_bytes in sorted(s for s in sizes if s * 2 <= size):
        ranges = spans_covering(size, span_bytes, fraction)
        spans_t, whole_t = [], []
        for _ in range(repeats):  # paired: whole, then spans
            whole_t.append(read_ranges(path, [(0, size)], workers))
            spans_t.append(read_ranges(path, ranges, workers))
        point = Point(span_bytes, len(ranges), float(np.median(spans_t)), float(np.median(whole_t)))
        points.append(point)
        if progress is not None:
            progress(point)
    breakeven = next((p.span_bytes for p in points if p.spans_s < p.whole_s), None)
    return Calibration(path, size, fraction, tuple(points), seeks[len(seeks) // 2], breakeven)
