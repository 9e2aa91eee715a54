"""The pages a rank's spans name, per file: what the vLLM benchmarks and tests compare a
rank's reads and page cache with."""

from __future__ import annotations

import os
from collections.abc import Iterable

from spanwarm.pagecache.residency import PAGE

__all__ = ["pages_by_file", "touched_bytes"]


def pages_by_file(spans: Iterable[tuple[str, int, int, int, int]]) -> dict[str, set[int]]:
    """Per file name (its base name), the pages ``(path, offset, length, stride, count)``
    spans touch."""
    out: dict[str, set[int]] = {}
    for path, offset, length, stride, count in spans:
        into = out.setdefault(os.path.basename(path), set())
        for row in range(count):
            start = offset + row * stride
            into.update(range(start // PAGE, (start + length - 1) // PAGE + 1))
    return out


def touched_bytes(ranks: Iterable[Iterable[tuple[str, int, int, int, int]]]) -> int:
    """Bytes of the pages the ranks' spans touch together."""
    union: dict[str, set[int]] = {}
    for spans in ranks:
        for name, pages in pages_by_file(spans).items():
            union.setdefault(name, set()).update(pages)
    return sum(len(pages) for pages in union.values()) * PAGE
