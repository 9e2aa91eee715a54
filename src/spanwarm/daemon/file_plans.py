"""Planning files for the node: each file's plan over all its users' spans, and the cells
that plan reads. Pure work on arrays, in the planning thread for a large batch."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from spanwarm.costmodel import FilePlan, plan_file
from spanwarm.spans import SpanTable, run_offsets

__all__ = ["FileToPlan", "plan_files"]

FileToPlan = tuple[str, int, SpanTable, int]  # path, size, its users' spans, seek cost


def plan_files(files: list[FileToPlan], chunk: int) -> list[tuple[FilePlan, npt.NDArray[np.int64]]]:
    """Each file's plan at its mount's seek cost, and every ``chunk``-byte cell the plan
    reads, in file order (the background queue)."""
    out = []
    for path, size, spans, seek_cost in files:
        plan = plan_file(path, size, spans, seek_cost)
        first, last = plan.runs.starts // chunk, (plan.runs.stops - 1) // chunk
        counts = last - first + 1
        out.append((plan, np.unique(np.repeat(first, counts) + run_offsets(counts))))
    return out
