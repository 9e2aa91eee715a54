"""One warm operation: a cell's ranges read into the page cache, piece by piece.

It runs in a worker thread. Pieces go in order, chunk/8 bytes each, halved (down to
128 KiB) each time one takes over ``PIECE_SECONDS``, so on slow storage an operation asked
to stop (its user must make way, nobody needs the file any more, the ranks read the cell
themselves) does so soon. What is resident already is not read again (where residency
can be believed). A piece the storage fails is narrowed down to its bad pages; the rest
is warmed. Each piece is recorded with the time its read completed: a piece warm before
a request came is not warm for it, however long the rest of the operation took.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from spanwarm.daemon.files import OpenFile
from spanwarm.daemon.page_cache import PageCache
from spanwarm.daemon.ranges import Range, subtract, total
from spanwarm.errors import FileChangedError
from spanwarm.pagecache.residency import PAGE
from spanwarm.pagecache.warm_engine import BadRange

__all__ = ["MIN_PIECE", "PIECES", "PIECE_SECONDS", "WarmOutcome", "Warmer"]

PIECES = 8  # an operation goes in chunk/8 pieces, and may stop between them
PIECE_SECONDS = 0.25  # a piece slower than this halves the next ones ...
MIN_PIECE = 128 * 2**10  # ... down to this


@dataclass(slots=True)
class WarmOutcome:
    """What one warm operation did."""

    read: int = 0  # bytes read from storage
    fetched: list[Range] = field(default_factory=list)  # the pieces those bytes were in
    verified: int = 0  # bytes found resident already
    kept: list[tuple[int, int]] = field(default_factory=list)  # --hold: (address, length)
    bad: list[BadRange] = field(default_factory=list)  # pages the storage failed
    # What it got to (it may stop early), piece by piece, each with when its read
    # completed. A failed piece's bad pages are in ``bad``.
    pieces: list[tuple[int, int, float]] = field(default_factory=list)
    done: float = 0.0  # when the last read completed (taken in the worker, not on the loop)

    @property
    def covered(self) -> list[Range]:
        return [(a, b) for a, b, _ in self.pieces]

    def good(self) -> list[tuple[int, int, float]]:
        """The pieces without their bad pages: what is warm, with when."""
        bad = [(b.start, b.stop) for b in self.bad]
        return [
            (a, b, when)
            for start, stop, when in self.pieces
            for a, b in subtract([(start, stop)], bad)
        ]


class Warmer:
    """Warm operations over one page cache.

    ``on_cold_read(file, nbytes, seconds)`` learns what one stream of cold reads gets;
    ``hold`` keeps what was warmed mapped (``FileSession.pin``).
    """

    def __init__(
        self,
        page_cache: PageCache,
        chunk: int,
        *,
        hold: bool = False,
        on_cold_read: Callable[[OpenFile, int, float], None] = lambda file, nbytes, s: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.page_cache = page_cache
        self.piece = max(PAGE, chunk // PIECES)
        self.hold = hold
        self._on_cold_read = on_cold_read
        self._clock = clock

    def warm(
        self, file: OpenFile, ranges: list[Range], should_stop: Callable[[], bool]
    ) -> WarmOutcome:
        """Warm what of ``ranges`` is not resident. ``should_stop`` is asked between
        pieces, once one is done. Raises FileChangedError when the file was replaced,
        deleted or moved out (nothing it read counts), OSError when it cannot be opened."""
        outcome = WarmOutcome()
        trusted = self.page_cache.trusted(file)
        # One look at the whole: a load of a resident checkpoint costs no stream (an open
        # is a round trip on a network mount) and no check per piece. Not with --hold,
        # whose pins need the pieces mapped.
        if ranges and trusted and not self.hold and self.page_cache.all_resident(file, ranges):
            outcome.verified = total(ranges)
            outcome.done = self._clock()
            outcome.pieces = [(a, b, outcome.done) for a, b in ranges]
            return outcome
        with self.page_cache.session(file, ranges) as session:
            for start, stop in self._pieces(ranges):
                if outcome.pieces and should_stop():
                    break
                resident = session.resident(start, stop) if trusted else 0
                if resident == stop - start:
                    outcome.verified += resident
                    outcome.pieces.append((start, stop, self._clock()))
                    continue
                try:
                    io_seconds = session.warm(start, stop)
                except FileChangedError:
                    raise
                except OSError:
                    outcome.bad.extend(session.bad_pages(start, stop))
                else:
                    if not resident:  # a cold read: what one stream gets here
                        self._on_cold_read(file, stop - start, io_seconds)
                # Taken after the read (its good pages, where it failed).
                outcome.pieces.append((start, stop, self._clock()))
                outcome.read += stop - start - resident
                outcome.fetched.append((start, stop))
                outcome.verified += resident
            # Replaced, deleted or moved out while these pieces were read: not ready.
            session.check_in_place()
            if self.hold:
                outcome.kept = session.pin([(a, b) for a, b, _ in outcome.good()])
        outcome.done = self._clock()
        return outcome

    def _pieces(self, ranges: list[Range]) -> Iterator[Range]:
        size = self.piece
        for start, stop in ranges:
            while start < stop:
                end = min(stop, start + size)
                began = self._clock()
                yield start, end
                if self._clock() - began > PIECE_SECONDS:
                    size = max(MIN_PIECE, size // 2)
                start = end
