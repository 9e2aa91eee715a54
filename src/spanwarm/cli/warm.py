"""``spanwarm warm PATH[:OFFSET:LENGTH]...``: warm files or ranges through the daemon."""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from spanwarm.cli.arguments import path_range
from spanwarm.client import Client, TensorSpans
from spanwarm.units import format_bytes


def _target(text: str) -> TensorSpans:
    path, offset, length = path_range(text)
    try:
        size = os.stat(path).st_size
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"{path}: {exc.strerror}") from None
    if length is None:
        length = size - offset
    return TensorSpans(text, os.path.abspath(path), offset, length, max(length, 1), 1)


def add_parser(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        "warm",
        help="warm files (or ranges of them) through the daemon and wait",
        description="Warm each PATH, or LENGTH bytes of it from OFFSET (like 4MiB), and wait.",
    )
    parser.add_argument("targets", nargs="+", type=_target, metavar="PATH[:OFFSET:LENGTH]")
    parser.add_argument("--socket", help="daemon socket (default: as `spanwarm serve`)")
    parser.add_argument(
        "--timeout", type=float, default=None, help="give up waiting after this many seconds"
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    client = Client(args.socket, read_yourself=False)  # warm everything, resident or not
    start = time.monotonic()
    try:
        ticket = client.request(args.targets, job="spanwarm-warm", rank=0)
        finished = ticket.wait(timeout=args.timeout)
        # Nothing here will read the bytes: end the request now rather than leave the
        # daemon waiting for reports of reads (the pages stay in the page cache).
        ticket.cancel()
    finally:
        client.close()
    elapsed = time.monotonic() - start
    progress = ticket.progress
    for plan in ticket.plan:
        print(
            f"{plan['path']}: {plan['decision']}, {format_bytes(plan['warm_bytes'])} in "
            f"{plan['num_runs']} runs (needed {format_bytes(plan['needed_bytes'])})"
        )
    print(
        f"warmed {progress.ready} of {progress.groups} targets, "
        f"{format_bytes(progress.bytes_ready)} in {elapsed:.2f} s"
    )
    for name, reason in ticket.failures.items():
        print(f"  {name}: {reason}", file=sys.stderr)
    if not finished:
        print(f"spanwarm warm: timed out after {args.timeout} s", file=sys.stderr)
        return 1
    return 0 if progress.ready == progress.groups else 1
