"""``spanwarm serve``: the node daemon."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from spanwarm.cli.arguments import size
from spanwarm.daemon.config import DaemonConfig
from spanwarm.errors import SpanwarmError


def add_parser(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        "serve",
        help="run the node daemon",
        description=(
            "Serve Warm and Status over a Unix socket: merge every local rank's spans, warm the "
            "page cache, stream per-tensor readiness. Needs no configuration."
        ),
    )
    defaults = DaemonConfig.__dataclass_fields__
    parser.add_argument(
        "--socket",
        help="Unix socket path (default: $SPANWARM_SOCKET, "
        "/run/spanwarm/spanwarm.sock as root, else per-user)",
    )
    parser.add_argument("--socket-group", help="group that may connect (socket mode 0660)")
    parser.add_argument(
        "--listen", help="also serve on this loopback TCP address, e.g. 127.0.0.1:7070"
    )
    parser.add_argument(
        "--allow",
        action="append",
        metavar="DIR",
        help="root whose files may be warmed (repeatable)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        help=f"warm operations in flight (default {defaults['workers'].default})",
    )
    parser.add_argument(
        "--chunk-size", dest="chunk_bytes", type=size, help="largest warm operation (default 8MiB)"
    )
    parser.add_argument(
        "--method",
        choices=("populate", "read", "hint"),
        help="how to warm (default: populate where supported)",
    )
    parser.add_argument("--seek-cost", type=size, help="price of one seek in bytes (default 12MiB)")
    parser.add_argument("--max-spans", type=int, help="most spans per request")
    parser.add_argument("--max-files", type=int, help="most files per request")
    parser.add_argument(
        "--drain-seconds", type=float, help="on SIGTERM, how long open streams may finish"
    )
    parser.add_argument(
        "--throttle",
        dest="throttle_bytes_per_s",
        type=size,
        metavar="RATE",
        help="cap the warm rate in bytes/s (for tests and demos)",
    )
    parser.add_argument(
        "--log-level", default="info", choices=("debug", "info", "warning", "error")
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from spanwarm.daemon.server import run as run_daemon

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    given = {
        name: value
        for name, value in vars(args).items()
        if name in DaemonConfig.__dataclass_fields__ and value is not None
    }
    if "allow" in given:
        given["allow"] = tuple(given["allow"])
    try:
        config = DaemonConfig(**given)
    except ValueError as exc:
        print(f"spanwarm serve: error: {exc}", file=sys.stderr)
        return 2
    try:
        return run_daemon(config)
    except (SpanwarmError, OSError) as exc:
        print(f"spanwarm serve: {exc}", file=sys.stderr)
        return 1
