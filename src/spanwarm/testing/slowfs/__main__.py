"""Serve an emulated network mount in the foreground until it is unmounted.

    python -m spanwarm.testing.slowfs SOURCE MOUNTPOINT --preset cross-region [--latency 0.02]
        [--stream-bw 268435456] [--total-bw none]
        [--fault NAME:START:LENGTH[:ERRNO]]... [--hang NAME:SECONDS[:START:LENGTH]]...

``--fault model.bin:8192:4096`` fails (EIO; or ERRNO, a number or a name such as ENODATA)
the read requests for model.bin, relative to SOURCE, that overlap its bytes [8192, 12288).
``--hang model.bin:30`` makes each read request for model.bin sleep 30 s before it is
served; ``--hang model.bin:30:0:4096`` only those overlapping its first 4096 bytes (LENGTH
``end``: to the end of the file). Both may be repeated. A NAME that contains ``:`` needs
every field.

Unmount with ``fusermount3 -u MOUNTPOINT`` (or Ctrl-C).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from spanwarm.testing.slowfs import PRESETS, Fault, Hang, resolve_preset, serve

_KNOBS = ("latency_s", "stream_bytes_per_s", "total_bytes_per_s")


def _bandwidth(text: str) -> float | None:
    """Bytes per second; ``none`` (or 0) for no cap."""
    if text.lower() in ("none", "0"):
        return None
    return float(text)


def _fault(text: str) -> Fault:
    try:
        return Fault.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _hang(text: str) -> Hang:
    try:
        return Hang.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m spanwarm.testing.slowfs",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("source", type=Path, help="directory to serve")
    parser.add_argument("mountpoint", type=Path)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="local")
    # Absent knobs stay absent (SUPPRESS), so "--stream-bw none" can differ from no option.
    suppress = argparse.SUPPRESS
    parser.add_argument(
        "--latency",
        dest="latency_s",
        type=float,
        default=suppress,
        help="seconds per seek (overrides the preset)",
    )
    parser.add_argument(
        "--stream-bw",
        dest="stream_bytes_per_s",
        type=_bandwidth,
        default=suppress,
        help="bytes/s per open file, or none",
    )
    parser.add_argument(
        "--total-bw",
        dest="total_bytes_per_s",
        type=_bandwidth,
        default=suppress,
        help="bytes/s for the whole mount, or none",
    )
    parser.add_argument(
        "--fault",
        dest="faults",
        type=_fault,
        action="append",
        default=[],
        metavar="NAME:START:LENGTH[:ERRNO]",
        help="fail reads of NAME overlapping [START, START+LENGTH) (repeatable)",
    )
    parser.add_argument(
        "--hang",
        dest="hangs",
        type=_hang,
        action="append",
        default=[],
        metavar="NAME:SECONDS[:START:LENGTH]",
        help="delay each read of NAME (overlapping the range) by SECONDS (repeatable)",
    )
    parser.add_argument("--name", help="label of the resulting preset in the stats")
    parser.add_argument("--debug", action="store_true", help="libfuse's request trace")
    parser.add_argument(
        "--allow-other",
        action="store_true",
        help="let other users use the mount (file modes apply; root only)",
    )
    parser.add_argument(
        "--trace", type=Path, help="append each served read request to this file (JSON lines)"
    )
    parser.add_argument(
        "--hang-flush",
        action="append",
        default=[],
        metavar="NAME",
        help="never answer a close() of NAME (its FLUSH), until unmounted (repeatable)",
    )
    args = vars(parser.parse_args(argv))
    overrides = {name: args.pop(name) for name in _KNOBS if name in args}
    preset = resolve_preset(args["preset"], **overrides)
    if args["name"]:
        preset = dataclasses.replace(preset, name=args["name"])
    serve(
        args["source"],
        args["mountpoint"],
        preset,
        faults=args["faults"],
        hangs=args["hangs"],
        debug=args["debug"],
        allow_other=args["allow_other"],
        trace=args["trace"],
        hang_flush=args["hang_flush"],
    )


if __name__ == "__main__":
    main()
