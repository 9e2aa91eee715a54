"""argparse types shared by the subcommands."""

from __future__ import annotations

import argparse

from spanwarm.units import parse_size

__all__ = ["path_range", "size"]


def size(text: str) -> int:
    """A byte size such as 12MiB, for argparse."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def path_range(text: str) -> tuple[str, int, int | None]:
    """``PATH[:OFFSET:LENGTH]`` as (path, offset, length or None for "to the end")."""
    parts = text.rsplit(":", 2)
    if len(parts) == 3:
        try:
            return parts[0], parse_size(parts[1]), parse_size(parts[2])
        except ValueError:
            pass  # a path with colons in it
    return text, 0, None
