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
from spanwarm.pagecache.residency import (
    cached_throughout,
    missing_bytes,
    open_trusted,
    probably_cached,
    residency_trusted,
    sampled_resident,
)

__all__ = ["ResidencyCheck", "distinct", "note_residency", "resident_files"]

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
_UNKNOWN = np.iinfo(np.int64).max // 2  # missing bytes of an envelope not looked at yet
_TRUE = np.ones(1, dtype=bool)


def distinct(values: Any) -> Any:
    """``np.unique(values)``, without it: its first call imports ``numpy.ma`` (8 ms here, on
    the loader's first tensors' path in a fresh rank process)."""
    ordered = np.sort(values)
    return ordered[_starts(ordered[1:] != ordered[:-1])] if len(ordered) else ordered


def _starts(changed: Any) -> Any:
    """``np.r_[True, changed]``, without it: index tricks cost 25 us a call, this 1."""
    return np.concatenate((_TRUE, changed))


def resident_files(
    files: list[str], envelopes: list[tuple[list[int], list[int]]], *, budget_s: float
) -> int:
    """How many of ``files``, in order, hold all of their ``envelopes`` (per file: first
    and last bytes) as far as :class:`ResidencyCheck`'s probe looks: a resident rank's
    check, in plain ints, with no arrays to build. Stops at the first file that does not
    (or will not open, or whose residency this process may not see: the full check
    samples those) and after about ``budget_s``; :class:`ResidencyCheck` goes on from
    there (``settled``)."""
    began = time.monotonic()
    for position, path in enumerate(files):
        if time.monotonic() - began > budget_s:
            return position
        fd = open_trusted(path)
        if fd < 0:
            return position
        try:
            lo, hi = envelopes[position]
            if not cached_throughout(fd, lo, hi):
                return position
        except (OSError, ValueError):
            return position
        finally:
            os.close(fd)
    return len(files)


def note_residency(ticket: Any, spans: Any, *, before: Callable[[], None] = lambda: None) -> Any:
    """:class:`ResidencyCheck` of ``ticket``'s ``spans``, all of it, with ``before`` run
    once the loader may look tensors up; returns which tensors are resident."""
    check = ResidencyCheck(ticket, spans)
    try:
        before()
        check.run()
    finally:
        check.close()
    return check.resident


class ResidencyCheck:
    """Which of ``ticket``'s tensors are in the page cache now: marked resident, and the
    waiters woken to look.

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
    comes, the loader may look it up itself (:mod:`.inline_residency`), from the moment
    the check is made (its envelopes known) to :meth:`close`.
    Where mincore cannot be believed (a file this process neither owns nor may write:
    the kernel then says every page is present), pages of each envelope are sampled
    instead, with reads that the page cache answers or refuses; there a tensor is
    resident when every page looked at is (no slack, and pages between samples unseen:
    the rank reads those itself)."""

    def __init__(self, ticket: Any, spans: Any, *, settled: int = 0) -> None:
        """The envelopes of ``spans``, published for the loader's own lookups; the first
        ``settled`` files were found resident throughout already (:func:`resident_files`)."""
        file_index = np.asarray(spans.file_index, dtype=np.int64)
        group_index = np.asarray(spans.group_index, dtype=np.int64)
        offset = np.asarray(spans.offset, dtype=np.int64)
        stride = np.asarray(spans.stride, dtype=np.int64)
        count = np.asarray(spans.count, dtype=np.int64)
        length = np.asarray(spans.length, dtype=np.int64)
        end = offset + np.maximum(count - 1, 0) * stride + length
        # One envelope per (tensor, file): its first and last byte there.
        order = np.lexsort((file_index, group_index))
        g, f = group_index[order], file_index[order]
        heads = np.flatnonzero(_starts((g[1:] != g[:-1]) | (f[1:] != f[:-1]))) if len(g) else g
        lo = np.minimum.reduceat(offset[order], heads) if len(g) else offset
        hi = np.maximum.reduceat(end[order], heads) if len(g) else end
        g, f = g[heads], f[heads]
        names = len(ticket._names)
        envelopes = np.bincount(g, weights=(hi - lo).astype(np.float64), minlength=names)
        self._slack = np.minimum(_RESIDENT_SLACK, envelopes / _RESIDENT_SLACK_SHARE)
        self._last_file = np.full(names, -1, dtype=np.int64)  # known once this one is
        np.maximum.at(self._last_file, g, f)
        self._ticket, self._files = ticket, list(spans.files)
        self._g, self._lo, self._hi = g, lo, hi
        self._missing = np.full(len(g), _UNKNOWN, dtype=np.int64)
        self._per_tensor = np.zeros(names, dtype=np.float64)  # missing, files looked at
        self._budget = _RESIDENCY_SCAN_BYTES  # the kernel looks up each page: bound it
        self._misses, self._samples = _SAMPLED_MISSES, _SAMPLED_READS
        self._deadline = time.monotonic() + _SAMPLED_SECONDS
        self._by_file = np.argsort(f, kind="stable")  # each file's envelopes, in one sort
        self._bounds = np.searchsorted(f[self._by_file], np.arange(len(self._files) + 1))
        # The probe's ranges as plain ints, file by file: numpy's cost per call is more
        # than a resident file's system calls.
        self._file_lo = lo[self._by_file].tolist()
        self._file_hi = hi[self._by_file].tolist()
        self._next = settled  # the next file to look at
        # Envelopes of the settled files, resident: published with the first run's.
        self._settled = self._by_file[: self._bounds[settled]]
        self._missing[self._settled] = 0
        self._lookups = TensorEnvelopes(self._files, g, f, lo, hi, names)
        self.resident = ticket._look_up_from(self._lookups)
        """Per tensor: resident (filled in as files are looked at)."""

    @property
    def done(self) -> bool:
        """Every file has been looked at."""
        return self._next >= len(self._files)

    def run(self, *, budget_s: float | None = None) -> bool:
        """Look at the files not looked at yet, in order. With ``budget_s``, only while
        every file looked at is resident and for about that long: the rest is left for
        another call, on another thread (the loader's need not wait for a slow mount,
        nor for a request that goes out anyway). Returns :attr:`done`."""
        bounds = self._bounds.tolist()
        began = time.monotonic()
        looked: list[Any] = []
        settled, self._settled = self._settled, self._settled[:0]
        if settled.size:
            looked.append(settled)
            if budget_s is None:
                self._publish(settled)
                looked = []
        while not self.done:
            position = self._next
            self._next += 1
            rows = slice(bounds[position], bounds[position + 1])
            mine = self._by_file[rows]
            cached = self._look_at(position, mine, rows)
            if budget_s is None:
                self._publish(mine)  # the loader is reading meanwhile: file by file
                continue
            looked.append(mine)
            if time.monotonic() - began > budget_s or (
                not cached and (self._missing[mine] > self._slack[self._g[mine]]).any()
            ):
                break
        if looked:  # in line, nobody looks before request() returns: once, at the end
            self._publish(np.concatenate(looked))
        return self.done

    def close(self) -> None:
        """No more lookups: after this nothing more is marked resident, so a request
        built from :attr:`resident` holds."""
        self._ticket._look_up_from(None)
        self._lookups.close()

    def _look_at(self, position: int, mine: Any, rows: slice) -> bool:
        """One file: the missing bytes of its envelopes ``mine`` (``rows`` of the
        by-file order); True when the probe found every one of them cached."""
        if not mine.size:
            return True
        lo, hi, missing = self._lo, self._hi, self._missing
        try:
            fd = os.open(self._files[position], os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            fd = -1  # its tensors stay not resident
        try:
            if fd < 0:
                pass
            elif residency_trusted(fd):
                probed = probably_cached(fd, self._file_lo[rows], self._file_hi[rows])
                if probed is not None and probed.all():  # resident: the common case, short
                    missing[mine] = 0
                    return True
                unseen = mine if probed is None else mine[~probed]
                if probed is not None:
                    missing[mine[probed]] = 0
                self._budget -= int((hi[unseen] - lo[unseen]).sum())
                if unseen.size and self._budget >= 0:  # not cached throughout: count exactly
                    missing[unseen] = missing_bytes(fd, lo[unseen], hi[unseen], reading_counts=True)
            elif self._misses > 0 and self._samples > 0:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # a missing page: one page
                sampled, self._misses, self._samples = sampled_resident(
                    fd,
                    lo[mine],
                    hi[mine],
                    misses=self._misses,
                    samples=self._samples,
                    deadline=self._deadline,
                )
                missing[mine] = np.where(sampled, 0, missing[mine])
        except (OSError, ValueError):
            pass
        finally:
            if fd >= 0:
                os.close(fd)
        return False

    def _publish(self, mine: Any) -> None:
        """Envelopes ``mine`` have been looked at: the tensors with all of theirs looked
        at are known, and resident where within their slack."""
        g, per_tensor = self._g, self._per_tensor
        np.add.at(per_tensor, g[mine], self._missing[mine].astype(np.float64))
        known = distinct(g[mine])
        known = known[self._last_file[known] < self._next]  # every envelope of these seen
        resident = known[per_tensor[known] <= self._slack[known]]
        self._ticket._looked_at(known, per_tensor[known], resident)
