"""argparse types shared by the subcommands."""

from __future__ import annotations

import argparse

from spanwarm.units import parse_size

__all__ = ["size"]


def size(text: str) -> int:
    """A byte size such as 12MiB, for argparse."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
