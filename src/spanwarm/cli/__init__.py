"""The ``spanwarm`` command line: one verb per subcommand, each in its own module."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

from spanwarm import __version__
from spanwarm.cli import calibrate, plan, residency, serve, status, warm

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    """Bad arguments: exit status 2 and one line saying what is wrong."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="spanwarm",
        description="Warm exactly the checkpoint bytes each rank of a distributed job will read.",
    )
    parser.add_argument("--version", action="version", version=f"spanwarm {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for command in (serve, status, warm, plan, residency, calibrate):
        command.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.run(args)
    except BrokenPipeError:  # `spanwarm plan ... | head`
        sys.stderr.close()
        return 0
    return code
