"""One warm of a whole file by spanwarm's engine, as the daemon does it; spawned per run by
bench_engine.py so every run starts with a fresh process.

    .venv/bin/python bench/engine_worker.py FILE METHOD [--workers 8] [--chunk-bytes N]

Cuts the file into chunk-aligned cells, hands them in order to a pool of ``workers``
threads, and each worker does what the daemon's ``_warm_blocking`` does with a cell: open
a fresh descriptor (one stream per operation, ``POSIX_FADV_RANDOM``), skip the cell when
mincore says it is resident already, else ``WarmEngine.warm(fd, [(start, stop)])``.
Prints one JSON line: the wall and CPU seconds (all threads) of the warm alone, so the
interpreter start and imports, which a running daemon never pays, can be told apart.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from spanwarm.daemon.config import DaemonConfig
from spanwarm.pagecache.residency import residency_trusted, resident_bytes
from spanwarm.pagecache.warm_engine import WarmEngine, WarmMethod


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this process
    return usage.ru_utime + usage.ru_stime


def warm_cell(engine: WarmEngine, path: str, start: int, stop: int, trusted: bool) -> int:
    """The daemon's per-cell step: probe residency, warm only when something is missing."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        if trusted and resident_bytes(fd, start, stop - start) == stop - start:
            return 0
        return engine.warm(fd, [(start, stop)])
    finally:
        os.close(fd)


def main() -> None:
    defaults = DaemonConfig()
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("file")
    parser.add_argument("method", choices=[m.value for m in WarmMethod])
    parser.add_argument("--workers", type=int, default=defaults.workers)
    parser.add_argument("--chunk-bytes", type=int, default=defaults.chunk_bytes)
    args = parser.parse_args()

    engine = WarmEngine(WarmMethod(args.method), chunk_bytes=args.chunk_bytes)
    fd = os.open(args.file, os.O_RDONLY | os.O_CLOEXEC)
    size = os.fstat(fd).st_size
    trusted = residency_trusted(fd)
    chunk = args.chunk_bytes
    cells = [(off, min(off + chunk, size)) for off in range(0, size, chunk)]
    with ThreadPoolExecutor(args.workers, thread_name_prefix="spanwarm-warm") as pool:
        # Start every thread before the clock: the daemon's pool is long since running.
        barrier = threading.Barrier(args.workers)
        for _ in range(args.workers):
            pool.submit(barrier.wait)
        pool.submit(lambda: None).result()
        wall0, cpu0 = time.perf_counter(), cpu_seconds()
        # The executor's queue hands cells out in order to whichever thread is free,
        # like the daemon's dispatcher keeping ``workers`` cells in flight.
        futures = [pool.submit(warm_cell, engine, args.file, a, b, trusted) for a, b in cells]
        warmed = sum(f.result() for f in futures)
        wall, cpu = time.perf_counter() - wall0, cpu_seconds() - cpu0
    os.close(fd)
    print(json.dumps({"wall_s": wall, "cpu_s": cpu, "bytes_warmed": warmed, "size": size}))


if __name__ == "__main__":
    main()
