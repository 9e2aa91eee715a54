"""Sparse spans and the cost model: 12.5% of a file read as spans of 4 KiB .. 64 MiB,
against reading all of it, on local storage and on each emulated mount.

    .venv/bin/python bench/bench_spans.py [--mounts local,nfs-like,cross-region] [--plot PNG]

Reads go through ``spanwarm.calibrate`` (the measurement behind ``spanwarm calibrate``):
the warm engine as the daemon issues it, 8 workers, one fresh descriptor (one stream) per
operation, ``POSIX_FADV_RANDOM``, the ``read`` method, operations of at most 8 MiB. The
file is evicted before every measurement. For each mount: the break-even span size
(below it, reading 12.5% as spans is slower than reading everything), a seek cost
calibrated from the fit ``t = t0 + spans x c`` (``S = c x`` the whole-file throughput),
and the cost model's decision at the 12 MiB default and at the calibrated S, next to
what was measured.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from spanwarm.calibrate import read_ranges, spans_covering
from spanwarm.costmodel import DEFAULT_SEEK_COST, plan_file
from spanwarm.spans import SpanTable
from spanwarm.units import format_bytes

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20
FRACTION = 8  # 12.5%
WORKERS = 8
SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, MiB, 4 * MiB, 16 * MiB, 64 * MiB]
# The slowest mount pays 50 ms per span: start it where a point takes seconds, not minutes.
SMALLEST = {"local": 4 << 10, "nfs-like": 16 << 10, "cross-region": 256 << 10}


@dataclass(frozen=True)
class Point:
    size: int
    spans: int
    spans_s: float
    whole_s: float
    ranges: list[tuple[int, int]]


def decision(ranges: list[tuple[int, int]], file_size: int, seek_cost: int) -> str:
    """What the cost model does with these spans: its decision and the bytes it reads."""
    starts = np.array([a for a, _ in ranges], dtype=np.int64)
    lengths = np.array([b - a for a, b in ranges], dtype=np.int64)
    table = SpanTable(starts, lengths, lengths, np.ones(len(ranges), dtype=np.int64))
    plan = plan_file("f", file_size, table, seek_cost)
    share = plan.warm_bytes / file_size
    return f"{plan.decision}, reads {share:.0%} in {plan.num_runs} runs"


@contextlib.contextmanager
def mounted(source: Path, preset: str) -> Iterator[Path | None]:
    if preset == "local":
        yield source
        return
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from bench.slowfs import fuse_available, mount

    reason = fuse_available()
    if reason is not None:
        print(f"{preset}: skipped, FUSE is not available here ({reason})")
        yield None
        return
    with (
        tempfile.TemporaryDirectory(prefix="sw-mnt-") as mnt,
        mount(source.parent, Path(mnt), preset),
    ):
        yield Path(mnt) / source.name


def measure(path: Path, preset: str, reps: int) -> dict[str, Any]:
    file_size = path.stat().st_size
    whole = [(0, file_size)]
    points: list[Point] = []
    for size in [s for s in SIZES if s >= SMALLEST[preset]]:
        ranges = spans_covering(file_size, size, 1 / FRACTION)
        spans_t, whole_t = [], []
        for _ in range(reps):  # paired and interleaved: whole, then spans
            whole_t.append(read_ranges(str(path), whole, WORKERS))
            spans_t.append(read_ranges(str(path), ranges, WORKERS))
        point = Point(
            size, len(ranges), statistics.median(spans_t), statistics.median(whole_t), ranges
        )
        points.append(point)
        print(
            f"  {preset} {format_bytes(size)}: {point.spans} spans {point.spans_s:.2f} s, "
            f"whole {point.whole_s:.2f} s",
            flush=True,
        )
    whole_s = statistics.median(p.whole_s for p in points)
    # Per extra span: the slope between the largest and the smallest span counts.
    few, many = points[-1], points[0]
    per_span = max(0.0, (many.spans_s - few.spans_s) / (many.spans - few.spans))
    calibrated = int(per_span * file_size / whole_s)
    return {"preset": preset, "points": points, "whole_s": whole_s, "seek_cost": calibrated}


def report(results: list[dict[str, Any]], file_size: int, command: str) -> str:
    lines = [
        "\n## Sparse spans and the cost model\n",
        f"```console\n{command}\n```\n",
        f"12.5% of a {format_bytes(file_size)} file, 8 workers, `read`, evicted before each "
        "read; medians of paired runs (whole file, then spans).\n",
    ]
    for r in results:
        lines += [
            f"\n### `{r['preset']}` (calibrated seek cost {format_bytes(r['seek_cost'])})\n",
            "| span | spans | 12.5% as spans | whole file | faster "
            "| model @ 12 MiB | model @ calibrated |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        breakeven = None
        for p in r["points"]:
            faster = "spans" if p.spans_s < p.whole_s else "whole"
            if faster == "spans" and breakeven is None:
                breakeven = p.size
            lines.append(
                f"| {format_bytes(p.size)} | {p.spans} | {p.spans_s:.2f} s "
                f"| {p.whole_s:.2f} s "
                f"| {faster} | {decision(p.ranges, file_size, DEFAULT_SEEK_COST)} "
                f"| {decision(p.ranges, file_size, r['seek_cost'])} |"
            )
        lines.append(
            f"\nBreak-even: spans win from {format_bytes(breakeven)} up."
            if breakeven
            else "\nSpans never won here."
        )
    return "\n".join(lines) + "\n"


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        xs = [p.size for p in r["points"]]
        (line,) = ax.plot(
            xs, [p.spans_s for p in r["points"]], marker="o", label=f"{r['preset']}: spans"
        )
        ax.axhline(
            r["whole_s"], color=line.get_color(), linestyle="--", label=f"{r['preset']}: whole file"
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("span size (bytes)")
    ax.set_ylabel("seconds (median)")
    ax.set_title("Reading 12.5% of a file as spans vs all of it")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mounts", default="local,nfs-like,cross-region")
    parser.add_argument("--size", default=str(1 << 30), type=int, help="file size in bytes")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--data", type=Path, default=Path("/var/tmp/spanwarm-bench"))
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    source = args.data / "spans" / f"file-{args.size}.bin"
    if not source.exists():
        source.parent.mkdir(parents=True, exist_ok=True)
        with open(source, "wb") as f:
            block = np.random.default_rng(1).integers(0, 256, 64 * MiB, dtype=np.uint8).tobytes()
            for _ in range(args.size // len(block)):
                f.write(block)
            os.fsync(f.fileno())
        with open(source, "rb") as f:  # fresh data reads slower once on this VM
            while f.read(64 * MiB):
                pass
    results = []
    for preset in args.mounts.split(","):
        with mounted(source, preset) as path:
            if path is not None:
                results.append(measure(path, preset, args.reps))
    text = report(results, args.size, "python bench/bench_spans.py " + " ".join(sys.argv[1:]))
    print(text)
    if args.markdown:
        args.markdown.write_text(text)
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
