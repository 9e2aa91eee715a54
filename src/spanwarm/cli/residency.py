"""``spanwarm residency PATH[:OFFSET:LENGTH]...``: how much of each file is in the page cache."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from spanwarm.cli.arguments import path_range
from spanwarm.pagecache.residency import residency_trusted, resident_bytes
from spanwarm.units import format_bytes


def add_parser(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        "residency", help="how much of each file (or range) is in the page cache"
    )
    parser.add_argument("targets", nargs="+", type=path_range, metavar="PATH[:OFFSET:LENGTH]")
    parser.add_argument("--json", action="store_true", help="one JSON object per target")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    status = 0
    for path, offset, length in args.targets:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as exc:
            print(f"spanwarm residency: {path}: {exc.strerror}", file=sys.stderr)
            status = 1
            continue
        try:
            size = os.fstat(fd).st_size
            span = size - offset if length is None else length
            resident = resident_bytes(fd, offset, span)
            trusted = residency_trusted(fd)
        finally:
            os.close(fd)
        share = resident / span if span else 1.0
        if args.json:
            print(json.dumps({"path": path, "offset": offset, "length": span,
                              "resident_bytes": resident, "trusted": trusted}))  # fmt: skip
            continue
        note = (
            "" if trusted else "  (cannot be trusted: this process neither owns nor may write it)"
        )
        where = "" if length is None and offset == 0 else f" [{offset}, {offset + span})"
        amount = f"{format_bytes(resident)} of {format_bytes(span)} resident ({share:.1%})"
        print(f"{path}{where}: {amount}{note}")
    return status
