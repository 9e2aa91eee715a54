"""What a rank finds in the page cache before its request goes out.

Tensors resident already are read at once and not asked for (``Client._consume``):
nothing the daemon does could make them sooner, and its work for them (grant, admission,
events, reports) would take CPU from the load on the node's cores. The check goes
file by file in request order and publishes each tensor once its last file is done, so
the loader reads its first tensors while the rest is checked; a loader that gets ahead
looks tensors up itself (:mod:`.inline_residency`).

``spans`` here is anything with a WarmRequest's span columns (``files``, ``file_index``,
``group_index``, ``offset``, ``length``, ``stride``, ``count``): the request itself, or
the columns it is built from once the check has said what to leave out.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from spanwarm.client.inline_residency import TensorEnvelopes
from spanwarm.residency import (
    missing_bytes,
    probably_cached,
    residency_trusted,
    sampled_resident,
)

__all__ = ["distinct", "note_residency"]

# A tensor this close to resident is read at once: a page or two of it can be missing (the
# page cache reclaims cold pages a few at a time), and a 64 KiB read is one request. At
# most an eighth of its envelopes, though: a small tensor missing whole is cold, and on a
# mount with 50 ms a request reading it is no cheaper than waiting for the daemon.
_RESIDENT_SLACK = 64 * 2**10
_RESIDENT_SLACK_SHARE = 8
# Bytes of envelopes checked for residency per request (about 16M page lookups, tens of
# milliseconds, where the probe finds them partly cold): past that, tensors count as not
# resident.
_RESIDENCY_SCAN_BYTES = 64 * 2**30
# Where mincore cannot be believed, pages are sampled instead (residency.sampled_resident):
# at most this many one-byte reads per request (about 20 ms), for at most this long (a
# busy device can hold each up), and no more after this many pages found missing (each
# one is read in: a cold checkpoint costs that many pages).
_SAMPLED_READS, _SAMPLED_SECONDS, _SAMPLED_MISSES = 8192, 0.02, 16


def distinct(values: Any) -> Any:
    """``np.unique(values)``, without it: its first call imports ``numpy.ma`` (8 ms here, on
    the loader's first tensors' path in a fresh rank process)."""
    ordered = np.sort(values)
    return ordered[np.r_[True, ordered[1:] != ordered[:-1]]] if len(ordered) else ordered


def note_residency(ticket: Any, spans: Any, *, before: Callable[[], None] = lambda: None) -> Any:
    """Find which of ``ticket``'s tensors are in the page cache now, mark them resident,
    and wake the waiters to look; returns that, per tensor.

    A tensor is resident when each of its envelopes (first to last byte of its spans, per
    file) is: probed in windows (``residency.probably_cached``: 64 KiB every 4 MiB of
    one over 1 MiB, so the cost follows the tensors, not their bytes: an exact count of
    a rank's resident share was a tenth of its load's CPU), and where a window is not,
    its missing pages counted, but for ``_RESIDENT_SLACK`` bytes, at most an eighth of
    it. A hole between windows goes unseen: the rank reads it cold, as it would without
    spanwarm; what the daemon says ready it has warmed itself. Pages still being read in
    (by the daemon for another rank, or by a reader) count as present: reading them here
    waits for that read, as waiting for the daemon would.
    Files are looked at in request order, and a tensor is marked as soon as its last file
    has been: the loader's first tensors are in the first files. Until a tensor's turn
    comes, the loader may look it up itself (:mod:`.inline_residency`), from right after
    the envelopes are known: ``before`` runs then, ahead of the files.
    Where mincore cannot be believed (a file this process neither owns nor may write:
    the kernel then says every page is present), pages of each envelope are sampled
    instead, with reads that the page cache answers or refuses; there a tensor is
    resident when every page looked at is (no slack, and pages between samples unseen:
    the rank reads those itself)."""
    file_index = np.asarray(spans.file_index, dtype=np.int64)
    group_index = np.asarray(spans.group_index, dtype=np.int64)
    offset = np.asarray(spans.offset, dtype=np.int64)
    stride = np.asarray(spans.stride, dtype=np.int64)
    count = np.asarray(spans.count, dtype=np.int64)
    end = offset + np.maximum(count - 1, 0) * stride + np.asarray(spans.length, dtype=np.int64)
    # One envelope per (tensor, file): its first and last byte there.
    order = np.lexsort((file_index, group_index))
    g, f = group_index[order], file_index[order]
    heads = np.flatnonzero(np.r_[True, (g[1:] != g[:-1]) | (f[1:] != f[:-1])]) if len(g) else g
    lo = np.minimum.reduceat(offset[order], heads) if len(g) else offset
    hi = np.maximum.reduceat(end[order], heads) if len(g) else end
    g, f = g[heads], f[heads]
    names = len(ticket._names)
    envelopes = np.bincount(g, weights=(hi - lo).astype(np.float64), minlength=names)
    slack = np.minimum(_RESIDENT_SLACK, envelopes / _RESIDENT_SLACK_SHARE)
    last_file = np.full(names, -1, dtype=np.int64)  # a tensor is known once this one is
    np.maximum.at(last_file, g, f)
    files = list(spans.files)
    lookups = TensorEnvelopes(files, g, f, lo, hi, names)
    resident = ticket._look_up_from(lookups)
    try:
        before()
        _check_files(ticket, files, g, f, lo, hi, slack, last_file)
    finally:
        ticket._look_up_from(None)
        lookups.close()  # after it, nothing more is marked resident: the selection holds
    return resident


def _check_files(
    ticket: Any,
    files: list[str],
    g: Any,
    f: Any,
    lo: Any,
    hi: Any,
    slack: Any,
    last_file: Any,
) -> None:
    """The file-by-file part of :func:`note_residency`: per file, the missing bytes of
    its envelopes, and the tensors whose last file it is marked known, and resident where
    those are within their slack."""
    names = len(ticket._names)
    missing = np.full(len(g), np.iinfo(np.int64).max // 2, dtype=np.int64)
    per_tensor = np.zeros(names, dtype=np.float64)  # missing bytes in the files looked at
    budget = _RESIDENCY_SCAN_BYTES  # the kernel looks up each page: bound the work
    misses, samples = _SAMPLED_MISSES, _SAMPLED_READS
    deadline = time.monotonic() + _SAMPLED_SECONDS
    by_file = np.argsort(f, kind="stable")  # each file's envelopes, without a pass per file
    bounds = np.searchsorted(f[by_file], np.arange(len(files) + 1)).tolist()
    for position, path in enumerate(files):
        mine = by_file[bounds[position] : bounds[position + 1]]
        if not mine.size:
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            fd = -1  # its tensors stay not resident
        try:
            if fd < 0:
                pass
            elif residency_trusted(fd):
                probed = probably_cached(fd, lo[mine], hi[mine])
                unseen = mine if probed is None else mine[~probed]
                if probed is not None:
                    missing[mine[probed]] = 0
                budget -= int((hi[unseen] - lo[unseen]).sum())
                if unseen.size and budget >= 0:  # not cached throughout: count exactly
                    missing[unseen] = missing_bytes(fd, lo[unseen], hi[unseen], reading_counts=True)
            elif misses > 0 and samples > 0:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # a missing page: one page
                sampled, misses, samples = sampled_resident(
                    fd, lo[mine], hi[mine], misses=misses, samples=samples, deadline=deadline
                )
                missing[mine] = np.where(sampled, 0, missing[mine])
        except (OSError, ValueError):
            pass
        finally:
            if fd >= 0:
                os.close(fd)
        np.add.at(per_tensor, g[mine], missing[mine].astype(np.float64))
        known = distinct(g[mine])
        known = known[last_file[known] == position]  # every envelope of these looked at
        ticket._looked_at(known, per_tensor[known], known[per_tensor[known] <= slack[known]])
