"""A rank's own cold reads, hinted to the kernel byte for byte before the loader reads.

When :meth:`Ticket.wait_for_read` tells the loader to read a tensor that is not warm,
the loader reads it through its own mapping or file object. A fault on a missing page of
a mapping reads the device's whole read-ahead window around it (``read_ahead_kb``: 8 MiB
on these VMs), so a 1 MiB slice costs 8 MiB, and scattered slices many times their
bytes (transformers on ``local``: 270 MiB read for a 90 MiB node plan). Just before the
loader reads, the rank asks for exactly the tensor's bytes with ``POSIX_FADV_WILLNEED``
(as the daemon does before it populates): the kernel starts reading those pages, and a
fault that then finds one in flight waits for it instead of reading around it.

Descriptors are the rank's own, opened on the first hint per file (the rank may read
these files: it is about to) and closed once no tensor of the request is pending.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import numpy as np

from spanwarm.pagecache.read_ahead import DEFAULT_WINDOW, hint_window
from spanwarm.pagecache.residency import PAGE, cached_pages

__all__ = ["OwnReads"]

logger = logging.getLogger("spanwarm.client")

# A strided span whose envelope is at most this many times its bytes is hinted whole;
# else row by row, for up to _ROWS_HINTED rows (a span of more is not hinted: the rank
# reads it as it would without spanwarm). Never more than twice a tensor's own bytes.
_ENVELOPE_SHARE = 2
_ROWS_HINTED = 1024
# Only a tensor's first bytes are hinted: the loader's faults are waste only around small
# slices (a large contiguous read's read-ahead windows are its own bytes), and a hint
# blocks once the device's queue is full, which must not hold the loader up for long.
_HINTED_BYTES = 32 * 2**20
# A range of more read-ahead windows than this is hinted by its first window only. Its
# windows hinted at once are as many requests of one descriptor in flight: on FUSE
# (128 KiB windows) up to 256 for one tensor, served out of order, each a seek to a
# network file system. The kernel's read-ahead keeps a stream's requests few and in
# order, and on such a device reads at most about a window past the tensor.
_WINDOWS_HINTED = 8
# Requests of more spans keep no spans for hints (about 36 bytes a span, held for the load).
MAX_HINTED_SPANS = 2**20


class OwnReads:
    """The spans of each tensor (group) of a request, and the rank's descriptors for them."""

    def __init__(self, request: Any) -> None:
        group = np.asarray(request.group_index, dtype=np.int64)
        order = np.argsort(group, kind="stable")
        self._files = list(request.files)
        self._file = np.asarray(request.file_index, dtype=np.int32)[order]
        self._offset = np.asarray(request.offset, dtype=np.int64)[order]
        self._length = np.asarray(request.length, dtype=np.int64)[order]
        self._stride = np.asarray(request.stride, dtype=np.int64)[order]
        self._count = np.asarray(request.count, dtype=np.int64)[order]
        groups = int(group.max()) + 1 if len(group) else 0
        self._ptr = np.searchsorted(group[order], np.arange(groups + 1))
        self._fds: dict[int, tuple[int, int]] = {}  # file position -> descriptor, window
        self._lock = threading.Lock()
        self._in_flight = 0  # hints running outside the lock: descriptors stay open
        self._ended = threading.Event()  # the request ended: no more hints

    @classmethod
    def of(cls, request: Any) -> OwnReads | None:
        """None for a request too large to keep its spans for the load. ``request``: a
        WarmRequest, or the span columns one is built from (same field names)."""
        return cls(request) if len(request.offset) <= MAX_HINTED_SPANS else None

    def ranges(self, group: int) -> list[tuple[int, int, int]]:
        """(file position, start, stop) to hint for one group, in its spans' order: its
        spans' bytes (a strided span's envelope where that is at most twice its bytes, or
        where its rows start at most a page apart: the loader faults every page of it
        then), up to ``_HINTED_BYTES`` of them, with ranges whose pages touch joined."""
        if not 0 <= group < len(self._ptr) - 1:
            return []
        out: list[tuple[int, int, int]] = []
        budget = _HINTED_BYTES
        for i in range(int(self._ptr[group]), int(self._ptr[group + 1])):
            f, off, length = int(self._file[i]), int(self._offset[i]), int(self._length[i])
            stride, count = int(self._stride[i]), int(self._count[i])
            if length <= 0 or count <= 0:
                continue
            if count == 1 or stride == length:
                rows = [(off, off + length * count)]
            elif 0 < stride <= max(_ENVELOPE_SHARE * length, PAGE):
                rows = [(off, off + (count - 1) * stride + length)]
            elif count <= _ROWS_HINTED:
                rows = [(off + r * stride, off + r * stride + length) for r in range(count)]
            else:
                continue
            for start, stop in rows:
                stop = min(stop, start + budget)
                _append_joined(out, f, start, stop)
                budget -= stop - start
                if budget <= 0:
                    return out
        return out

    def hint(self, group: int) -> float | None:
        """Start reading the group's bytes (``WILLNEED``), without waiting for them, and
        return the share of its pages (those :meth:`ranges` gives) that were not in the page
        cache just before (pages still being read count as there); None where that is not
        known (nothing to hint, or ``cachestat`` refused). Any error only means no hint
        (the loader's read will say what is wrong). Nothing blocks under the lock: an open
        or a hint on a hung file system holds up only the thread about to read that file
        anyway.

        The share keeps the rank's own rate honest (``Ticket.took``): a tensor the daemon
        has partly brought, but not yet reported warm, reads in a fraction of a cold
        read's time, and counted whole it made one stream of a network mount look 6x as
        fast as it is (3 MiB in 5 ms on the emulated cross-region mount)."""
        ranges = self.ranges(group)
        if not ranges:
            return None
        with self._lock:
            if self._ended.is_set():
                return None
            self._in_flight += 1  # from here on no descriptor is closed under this hint
        pages = absent = 0
        known = True
        try:
            fds = {f: self._descriptor(f) for f in {f for f, _, _ in ranges}}
            for f, start, stop in ranges:
                fd, window = fds[f]
                if fd < 0:
                    known = False
                    continue
                if known:
                    first = start - start % PAGE
                    span = (stop - first + PAGE - 1) // PAGE
                    cached = cached_pages(fd, first, span * PAGE)
                    known = cached is not None
                    pages += span
                    absent += span - min(cached or 0, span)
                # In pieces the kernel does not cut (read_ahead.hint_window), a few at
                # most: beyond that only the first, and the loader's reads stream the rest
                # through the kernel's read-ahead, in order (see _WINDOWS_HINTED).
                if stop - start > _WINDOWS_HINTED * window:
                    stop = start + window
                for at in range(start, stop, window):
                    os.posix_fadvise(fd, at, min(window, stop - at), os.POSIX_FADV_WILLNEED)
        except Exception as exc:  # a hint must never fail the read it is for
            logger.debug("spanwarm: no read-ahead hint for group %d: %s", group, exc)
            known = False
        finally:
            with self._lock:
                self._in_flight -= 1
                last = self._ended.is_set() and not self._in_flight
            if last:
                self._close_all()
        return absent / pages if known and pages else None

    def close(self) -> None:
        """No more hints: close the descriptors (once no hint still uses them)."""
        with self._lock:
            self._ended.set()
            last = not self._in_flight
        if last:
            self._close_all()

    def _descriptor(self, position: int) -> tuple[int, int]:
        """The rank's descriptor for a file of the request, opened once (-1: it will not
        open), and its device's hint window. Called with a hint in flight, so none is
        closed meanwhile; one opened after the last close began is closed by the hint's
        own end."""
        with self._lock:
            opened = self._fds.get(position)
        if opened is not None:
            return opened
        try:
            fd = os.open(self._files[position], os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except (OSError, IndexError, ValueError):
            opened = (-1, DEFAULT_WINDOW)  # not hinted; the loader's own open says why
        else:
            try:
                opened = (fd, hint_window(os.fstat(fd).st_dev))
            except OSError:
                opened = (fd, DEFAULT_WINDOW)
        with self._lock:
            kept = self._fds.setdefault(position, opened)
        if kept != opened and opened[0] >= 0:
            os.close(opened[0])  # another thread opened it first
        return kept

    def _close_all(self) -> None:
        """Outside the lock: a close on FUSE waits for the server's FLUSH."""
        with self._lock:
            fds, self._fds = self._fds, {}
        for fd, _ in fds.values():
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError as exc:  # a flush error: the descriptor is gone all the same
                    logger.debug("spanwarm: closing a hint descriptor: %s", exc)

    @property
    def open_descriptors(self) -> int:
        with self._lock:
            return sum(1 for fd, _ in self._fds.values() if fd >= 0)


def _append_joined(out: list[tuple[int, int, int]], f: int, start: int, stop: int) -> None:
    """Append a range to hint, joined to the last one where their pages touch: a hint is
    read in requests of its own pages, so rows of a page each, hinted one by one, are one
    request a page (a TP slice of 1 KiB rows 4 KiB apart: 162 requests of 4 KiB on FUSE,
    each a round trip, where its pages are 2 windows). Joined, no page is added."""
    if out:
        last_f, last_start, last_stop = out[-1]
        if last_f == f and last_start <= start and start // PAGE <= (last_stop - 1) // PAGE + 1:
            out[-1] = (f, last_start, max(last_stop, stop))
            return
    out.append((f, start, stop))
