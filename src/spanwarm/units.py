"""Byte sizes as people write them: ``12MiB``, ``1.5GiB``, ``4096``."""

from __future__ import annotations

import re

__all__ = ["format_bytes", "parse_size"]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 2**10,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 2**20,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 2**30,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 2**40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*")


def parse_size(text: str) -> int:
    """Bytes in ``text``; binary (KiB, MiB, GiB, TiB) and decimal (kB, MB, GB, TB) units."""
    match = _SIZE.fullmatch(text)
    unit = match[2].lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"not a byte size: {text!r} (try 12MiB, 1.5GiB or 4096)")
    return round(float(match[1]) * _UNITS[unit])


def format_bytes(n: int) -> str:
    """``n`` bytes in binary units with one decimal: ``12.0 MiB``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
