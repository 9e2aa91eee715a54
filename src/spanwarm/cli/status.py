"""``spanwarm status``: what the node's daemon is doing, once, as JSON, or live."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import unicodedata
from typing import Any

import grpc
from rich.console import Console, Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from spanwarm.client import Client
from spanwarm.client.access import EndpointUnsafe
from spanwarm.units import format_bytes


def add_parser(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        "status", help="jobs, ranks, files, bytes planned and warm, throughput, ETA"
    )
    parser.add_argument("--socket", help="daemon socket (default: as `spanwarm serve`)")
    parser.add_argument("--json", action="store_true", help="print the status as JSON")
    parser.add_argument("--watch", action="store_true", help="refresh until interrupted")
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between refreshes")
    parser.set_defaults(run=run)


def shown(value: object) -> Text:
    """A value a user named (a job, a file, a mount) as plain text for root's terminal:
    no markup, no links, and every control or format character (escapes, newlines,
    bidirectional overrides) written out as its escape, so no name can move the cursor,
    retitle the window or draw a row of its own."""
    return Text("".join(_visible(c) for c in str(value)), no_wrap=False)


def _visible(c: str) -> str:
    if unicodedata.category(c)[0] == "C" or c in "\u2028\u2029":
        return c.encode("unicode_escape").decode("ascii")
    return c


def _rate(bytes_per_s: float) -> str:
    return f"{format_bytes(int(bytes_per_s))}/s"


def render(status: dict[str, Any]) -> Group:
    """The status as rich renderables: a summary line, ranks with progress bars, files."""
    planned, warm = status["bytes_planned"], status["bytes_warm"]
    lines = [
        f"spanwarm {status['version']}  up {status['uptime_s']:.0f} s  method {status['method']}  "
        f"{status['workers']} workers",
        f"planned {format_bytes(planned)}  warm {format_bytes(warm)}  "
        f"requested {format_bytes(status['bytes_requested'])}  "
        f"read {format_bytes(status['bytes_read_total'])}  "
        f"already resident {format_bytes(status['bytes_verified_total'])}",
        f"{_rate(status['throughput_bytes_per_s'])}  ETA {status['eta_s']:.1f} s  "
        f"queue {status['queue_depth']}  in flight {status['in_flight']}",
        f"budget {format_bytes(status['budget_bytes'])}, held {format_bytes(status['held_bytes'])}"
        + (f"  waiting: {status['waiting_reason']}" if status["waiting_for_budget"] else ""),
    ]
    if status.get("refusals"):  # shown to root and the daemon's user; its log says more
        lines.append(
            "refused: " + ", ".join(f"{r['cause']} {r['count']}" for r in status["refusals"])
        )
    summary = Text("\n").join(shown(line) for line in lines)
    ranks = Table("job", "rank", "tensors", "", "bytes ready", title="ranks", title_justify="left")
    for r in status["ranks"]:
        done = r["groups_ready"] + r["groups_failed"]
        ranks.add_row(
            shown(r["job"]),
            shown(r["rank"]),
            f"{r['groups_ready']}/{r['groups']}"
            + (f" ({r['groups_failed']} failed)" if r["groups_failed"] else ""),
            ProgressBar(total=max(r["groups"], 1), completed=done, width=30),
            f"{format_bytes(r['bytes_ready'])} of {format_bytes(r['bytes_requested'])}",
        )
    files = Table(
        "file",
        "size",
        "needed",
        "runs",
        "decision",
        "",
        "warm",
        title="files",
        title_justify="left",
    )
    for f in status["files"]:
        files.add_row(
            shown(f["path"]),
            format_bytes(f["size_bytes"]),
            format_bytes(f["needed_bytes"]),
            str(f["num_runs"]),
            shown(f["decision"]),
            ProgressBar(total=max(f["warm_bytes"], 1), completed=f["warm_now_bytes"], width=20),
            f"{format_bytes(f['warm_now_bytes'])} of {format_bytes(f['warm_bytes'])}",
        )
    mounts = Table(
        "mount",
        "one stream",
        "read cold",
        "seek cost, probed",
        title="mounts",
        title_justify="left",
    )
    for m in status.get("mounts", []):
        rate, seek_cost = m["stream_bytes_per_s"], m.get("seek_cost_bytes", 0)
        again = " (probed again when idle)" if seek_cost and m.get("seek_probe_due") else ""
        mounts.add_row(
            shown(m["mount"]),
            _rate(rate) if rate else "not known yet",
            format_bytes(m["sampled_bytes"]),
            format_bytes(seek_cost) + again if seek_cost else "not yet",
        )
    parts: list[Any] = [summary]
    if status["ranks"]:
        parts.append(ranks)
    if status["files"]:
        parts.append(files)
    if status.get("mounts"):
        parts.append(mounts)
    return Group(*parts)


def run(args: argparse.Namespace) -> int:
    # Ctrl-C ends the watch between calls. A KeyboardInterrupt raised wherever the main
    # thread is can be swallowed by a library or land inside a gRPC call in flight, after
    # which the channel may not close (grpc/grpc#19973); once, a watch outlived its SIGINT.
    # Every call has a 5 s deadline, so the end is never further off than that.
    interrupted = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda *_: interrupted.set())
    client = Client(args.socket, timeout=5.0)
    console = Console()
    try:
        if args.json:
            json.dump(client.status(), sys.stdout, indent=2)
            print()
        elif not args.watch:
            console.print(render(client.status()))
        else:
            with Live(render(client.status()), console=console, refresh_per_second=4) as live:
                while not interrupted.wait(args.interval):
                    live.update(render(client.status()))
    except (grpc.RpcError, OSError) as exc:
        code = exc.code().name if isinstance(exc, grpc.RpcError) else "UNAVAILABLE"
        print(f"spanwarm status: no daemon answering at {client.socket} ({code})", file=sys.stderr)
        return 1
    except EndpointUnsafe as exc:
        print(f"spanwarm status: not using {client.socket}: {exc}", file=sys.stderr)
        return 2
    finally:
        client.close()
        signal.signal(signal.SIGINT, previous)
    return 0
