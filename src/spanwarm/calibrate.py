"""Measure the seek cost of the storage under a file, the way the seed did.

Read a fixed 12.5% of the file as spans of one size, for sizes from small to large,
with the page cache evicted before every point, and read the whole file for reference.
Reading spans costs ``t = t0 + spans x c``: ``c`` is the price of one more span, and the
seek cost in bytes is ``c`` times the whole-file throughput (what a sequential read gets
through while one seek is paid). The break-even span size is where 12.5% as spans stops
being slower than everything.

Reads go through the warm engine as the daemon issues them: fresh descriptors per
operation, ``POSIX_FADV_RANDOM``, the ``read`` method, operations of at most 8 MiB. By
default with one worker: one stream, so ``c`` is one seek and the throughput one stream's,
which is what the cost model's S means. More workers measure faster, but aggregate limits
of the storage then skew the product.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from spanwarm.daemon.warm_engine import WarmEngine, WarmMethod
from spanwarm.residency import evict

__all__ = ["Calibration", "Point", "calibrate", "read_ranges", "spans_covering"]

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
    seek_cost: int
    """Bytes one seek costs: the price of one more span times the whole-file throughput."""
    breakeven: int | None
    """Smallest span size at which reading the fraction as spans beat reading everything."""


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


def calibrate(
    path: str,
    *,
    sizes: Sequence[int] = DEFAULT_SIZES,
    fraction: float = 0.125,
    workers: int = 1,
    repeats: int = 1,
    progress: Callable[[Point], None] | None = None,
) -> Calibration:
    """Measure every span size (paired with a whole-file read) and derive the seek cost."""
    size = os.stat(path).st_size
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
    if len(points) < 2:
        raise ValueError(f"{path}: {size} bytes is too small to calibrate on")
    counts = np.array([p.spans for p in points], dtype=float)
    times = np.array([p.spans_s for p in points])
    per_span = max(0.0, float(np.polyfit(counts, times, 1)[0]))
    whole_s = float(np.median([p.whole_s for p in points]))
    breakeven = next((p.span_bytes for p in points if p.spans_s < p.whole_s), None)
    return Calibration(
        path, size, fraction, tuple(points), int(per_span * size / whole_s), breakeven
    )
