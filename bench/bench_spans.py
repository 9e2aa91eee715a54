"""Sparse spans and the cost model: 12.5% of a file read as spans of 4 KiB .. 64 MiB,
against reading all of it, on local storage and on each emulated mount.

    .venv/bin/python bench/bench_spans.py [--mounts local,nfs-like,cross-region] [--plot PNG]

Reads go through ``spanwarm.planning.calibrate`` (the measurement behind ``spanwarm calibrate``):
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
from pathlib import Path

import numpy as np

from spanwarm.checkpoint.spans import SpanTable
from spanwarm.planning.calibrate import Calibration, calibrate, spans_covering
from spanwarm.planning.calibrate import Point as CalibrationPoint
from spanwarm.planning.costmodel import DEFAULT_SEEK_COST, plan_file
from spanwarm.units import format_bytes

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20
FRACTION = 8  # 12.5%
WORKERS = 8
SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, MiB, 4 * MiB, 16 * MiB, 64 * MiB]
# The slowest mount pays 50 ms per span: start it where a point takes seconds, not minutes.
SMALLEST = {"local": 4 << 10, "nfs-like": 16 << 10, "cross-region": 256 << 10}


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
    from spanwarm.testing.slowfs import fuse_available, mount

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


def measure(path: Path, preset: str, reps: int) -> Calibration:
    """``spanwarm calibrate``'s measurement, with the daemon's 8 workers."""

    def show(point: CalibrationPoint) -> None:
        print(
            f"  {preset} {format_bytes(point.span_bytes)}: {point.spans} spans "
            f"{point.spans_s:.2f} s, whole {point.whole_s:.2f} s",
            flush=True,
        )

    sizes = [s for s in SIZES if s >= SMALLEST[preset]]
    return calibrate(
        str(path), sizes=sizes, fraction=1 / FRACTION, workers=WORKERS, repeats=reps, progress=show
    )


def report(results: list[tuple[str, Calibration]], file_size: int, command: str) -> str:
    lines = [
        "\n## Sparse spans and the cost model\n",
        f"```console\n{command}\n```\n",
        f"12.5% of a {format_bytes(file_size)} file, 8 workers, `read`, evicted before each "
        "read; medians of paired runs (whole file, then spans).\n",
    ]
    for preset, result in results:
        lines += [
            f"\n### `{preset}` (calibrated seek cost {format_bytes(result.seek_cost)})\n",
            "| span | spans | 12.5% as spans | whole file | faster "
            "| model @ 12 MiB | model @ calibrated |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for p in result.points:
            ranges = spans_covering(file_size, p.span_bytes, result.fraction)
            lines.append(
                f"| {format_bytes(p.span_bytes)} | {p.spans} | {p.spans_s:.2f} s "
                f"| {p.whole_s:.2f} s "
                f"| {'spans' if p.spans_s < p.whole_s else 'whole'} "
                f"| {decision(ranges, file_size, DEFAULT_SEEK_COST)} "
                f"| {decision(ranges, file_size, result.seek_cost)} |"
            )
        lines.append(
            f"\nBreak-even: spans win from {format_bytes(result.breakeven)} up."
            if result.breakeven
            else "\nSpans never won here."
        )
    return "\n".join(lines) + "\n"


def plot(results: list[tuple[str, Calibration]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for preset, result in results:
        xs = [p.span_bytes for p in result.points]
        (line,) = ax.plot(
            xs, [p.spans_s for p in result.points], marker="o", label=f"{preset}: spans"
        )
        whole_s = statistics.median(p.whole_s for p in result.points)
        ax.axhline(whole_s, color=line.get_color(), linestyle="--", label=f"{preset}: whole file")
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
                results.append((preset, measure(path, preset, args.reps)))
    text = report(results, args.size, "python bench/bench_spans.py " + " ".join(sys.argv[1:]))
    print(text)
    if args.markdown:
        args.markdown.write_text(text)
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
