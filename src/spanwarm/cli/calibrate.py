"""``spanwarm calibrate PATH``: measure the seek cost of the mount holding PATH."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

from spanwarm.cli.arguments import size
from spanwarm.planning.calibrate import DEFAULT_SIZES, Point, calibrate
from spanwarm.units import format_bytes


def add_parser(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        "calibrate",
        help="measure the seek cost of the storage under a file",
        description=(
            "Price one seek on PATH's storage (one stream's sequential rate times the time of "
            "one seek, the page cache evicted first) and recommend --seek-cost; then read 12.5%% "
            "of PATH as spans of varying size and all of it, to find where spans stop beating "
            "the whole file. Use a large file (>= 1 GiB) on the mount to measure; it is only "
            "read. The daemon takes the same measurement of each mount by itself."
        ),
    )
    parser.add_argument("path", type=Path)
    parser.add_argument(
        "--workers", type=int, default=1, help="reads in flight (default 1: one stream, as S means)"
    )
    parser.add_argument("--repeats", type=int, default=1, help="paired runs per point (median)")
    parser.add_argument(
        "--sizes",
        type=lambda text: [size(t) for t in text.split(",")],
        default=list(DEFAULT_SIZES),
        help="span sizes, comma-separated (default 16KiB..64MiB)",
    )
    parser.add_argument(
        "--write-config", type=Path, metavar="TOML", help="set seek_cost in this file"
    )
    parser.set_defaults(run=run)


def _print_point(point: Point) -> None:
    faster = "spans" if point.spans_s < point.whole_s else "whole"
    print(
        f"{format_bytes(point.span_bytes):>10}  {point.spans:>7} spans  {point.spans_s:7.3f} s"
        f"   whole {point.whole_s:7.3f} s   {faster}",
        flush=True,
    )


def write_seek_cost(path: Path, seek_cost: int) -> None:
    """Set ``seek_cost`` in a TOML file, keeping everything else."""
    line = f"seek_cost = {seek_cost}  # bytes, measured by spanwarm calibrate"
    text = path.read_text() if path.exists() else ""
    if re.search(r"^seek_cost\s*=.*$", text, flags=re.M):
        text = re.sub(r"^seek_cost\s*=.*$", line, text, count=1, flags=re.M)
    else:
        text = (text.rstrip("\n") + "\n" if text else "") + line + "\n"
    path.write_text(text)


def run(args: argparse.Namespace) -> int:
    if not args.path.is_file():
        print(f"spanwarm calibrate: {args.path}: not a regular file", file=sys.stderr)
        return 2
    print(f"{args.path}: 12.5% as spans vs the whole file, cache evicted before each read")
    try:
        result = calibrate(
            str(args.path),
            sizes=args.sizes,
            workers=args.workers,
            repeats=args.repeats,
            progress=_print_point,
        )
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"spanwarm calibrate: {exc}", file=sys.stderr)
        return 1
    breakeven = format_bytes(result.breakeven) if result.breakeven else "never (read whole files)"
    print(f"break-even span size: {breakeven}")
    seek = result.seek
    print(
        f"one seek: {seek.seek_s * 1e3:.2f} ms (over {seek.seeks} seeks); one stream: "
        f"{seek.stream_bytes_per_s / 2**20:.1f} MiB/s"
    )
    print(f"recommended: --seek-cost {result.seek_cost}  ({format_bytes(result.seek_cost)})")
    if args.write_config:
        write_seek_cost(args.write_config, result.seek_cost)
        print(f"wrote seek_cost = {result.seek_cost} to {args.write_config}")
    return 0
