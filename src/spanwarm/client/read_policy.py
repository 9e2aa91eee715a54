"""When a rank waits for the daemon before a read, and when it reads a tensor itself.

Waiting pays only while the daemon brings a tensor sooner than the rank would read it
cold here. How long that read takes is estimated per tensor: first from the grant's
rate of one stream on the slowest mount, then from the plan's rate per file, and, once a
loader has timed a few of its own cold reads (:meth:`ReadPolicy.took`), from those where
they are faster. Only the tensor's cold bytes count: a tensor the residency check found
mostly cached is one short read away. How the daemon has been doing bounds waits too: a
daemon slower at this request than the rank's own reads (:meth:`ReadPolicy.daemon_slower`),
or one too often not ahead of the rank (:meth:`ReadPolicy.daemon_behind`), is not waited
for at all.

Plain numbers in, decisions out: times are passed in (monotonic seconds) and nothing
here sleeps, locks or touches a file. The ticket holds its lock around every call.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

__all__ = [
    "BEHIND_WINDOW",
    "DELIVERED_BYTES",
    "OWN_BYTES",
    "OWN_SAMPLES",
    "PIECE_BYTES",
    "WORTH_ASKING_S",
    "WORTH_ASKING_SHARE",
    "WORTH_WAITING_S",
    "ReadPolicy",
    "Step",
    "plan_rates",
    "read_times",
]

PIECE_BYTES = 2**20  # a read of the daemon's piece size (chunk/8): latency and all
BEHIND_WINDOW = 16  # bounded waits remembered (see ReadPolicy.daemon_behind)
# A bounded wait shorter than this is not begun: a waiting thread wakes up to a GIL
# switch interval (5 ms) late while another thread of the rank runs Python, later still
# on a busy node (transformers' loader here: waits bounded at 1.3 ms took 2-37 ms). The
# rank reads at once instead; the page cache shares whatever the daemon reads meanwhile.
WORTH_WAITING_S = 0.01
# A request the page cache holds but for an eighth at most, whose cold bytes this rank
# would read in less than this at the grant's rate of one stream, is not sent: the rank
# reads them itself. Asking costs about that much on the node's cores (the gRPC channel,
# the stream, the daemon's plan and events: 40-50 ms of CPU a rank here), and a few pages
# reclaimed here and there leave nothing a daemon could read much faster. On a slow
# mount (20 MB/s a stream) under 1 MB cold is kept back. A cold load goes out however
# small: it shows in `spanwarm status`, and other ranks and jobs share what it reads.
WORTH_ASKING_S = 0.05
WORTH_ASKING_SHARE = 8
OWN_SAMPLES, OWN_BYTES = 4, 4 * 2**20  # own cold reads timed before they bound waits
# How fast the daemon brings this request's tensors is known once it has brought this
# much (see ReadPolicy.daemon_slower).
DELIVERED_BYTES = 8 * 2**20


@dataclass(frozen=True)
class Step:
    """What a reader of a pending tensor does next: ``"read"`` it now, give up
    (``"timeout"``), or ``"wait"`` until ``until`` (monotonic; inf: until woken) and ask
    again. ``bounded``: this wait is bounded by the rank's own read, and how it ends
    counts for :meth:`ReadPolicy.daemon_behind`."""

    outcome: Literal["read", "timeout", "wait"]
    until: float = math.inf
    bounded: bool = False


_READ = Step("read")
_TIMEOUT = Step("timeout")


class ReadPolicy:
    """One request's estimates of reading each tensor here, and what they decide.

    Tensors are numbered as in the request; ``nbytes`` are each one's bytes."""

    def __init__(self, nbytes: Sequence[int]) -> None:
        self._nbytes = np.asarray(nbytes, dtype=np.float64)
        self.total_bytes = int(sum(nbytes))
        self.read_yourself_s: Any = np.full(len(nbytes), np.inf)
        """Per tensor: how long reading it cold here takes (inf: not known yet)."""
        # Per tensor: what reading it here would fetch from storage. All of it, until the
        # residency check finds pages of it in the page cache already: a tensor missing a
        # few pages is one short read away, not a whole cold one.
        self.cold_bytes: Any = self._nbytes.copy()
        self.granted_rate = 0.0
        """The grant's rate of one stream on the slowest mount (0: not known)."""
        self.waits: collections.deque[bool] = collections.deque(maxlen=BEHIND_WINDOW)
        """How the last bounded waits ended (True: warm in time)."""
        self._skipped = 0  # waits skipped since the daemon fell behind
        # Told to read it itself, not timed yet -> the share of it not in the page cache
        # as the read began (see hinted; 1.0 where not known).
        self._told: dict[int, float] = {}
        self._own_samples: collections.deque[tuple[int, float]] = collections.deque(
            maxlen=BEHIND_WINDOW
        )
        self._own_bytes = 0
        self._own_seconds = 0.0
        # What the daemon has brought since its first tensor of the request: cold bytes
        # of tensors it warmed (see daemon_slower).
        self._delivering_since: float | None = None
        self._delivered = 0.0

    # -- what the residency check found ------------------------------------------------

    def missing(self, tensors: Any, missing: Any) -> None:
        """At most ``missing`` bytes of each of ``tensors`` are not in the page cache."""
        self.cold_bytes[tensors] = np.minimum(self.cold_bytes[tensors], missing)

    def cached(self, tensors: Any) -> None:
        """``tensors`` (numbers, or a slice) are wholly in the page cache."""
        self.cold_bytes[tensors] = 0.0

    def cold_share(self) -> Any:
        """Per tensor: the share of its bytes a read here fetches from storage."""
        total = self._nbytes
        return np.divide(self.cold_bytes, total, out=np.ones_like(total), where=total > 0)

    # -- before the request goes out ---------------------------------------------------

    def keeps_back(self, tensors: Any) -> bool:
        """Whether this rank reads ``tensors`` (what a request would ask for) sooner than
        asking would cost: their cold bytes are at most an eighth of the request's and at
        the grant's rate of one stream take under :data:`WORTH_ASKING_S`. Nothing learned
        about the mount yet: ask."""
        rate = self.granted_rate
        if not rate > 0:
            return False
        cold = float(self.cold_bytes[tensors].sum())
        return not (cold * WORTH_ASKING_SHARE > self.total_bytes or cold / rate >= WORTH_ASKING_S)

    # -- before a read -----------------------------------------------------------------

    def bound(self, tensor: int) -> float:
        """How long this rank would take to read ``tensor`` cold here: the daemon's
        figure, or the rank's own rate where that is faster (only ever lower: the
        daemon's figure is one of its streams among many, far below what a rank gets
        where the storage is fast; and one request's reads of a slow mount must not
        lengthen its waits on a fast one)."""
        bound = float(self.read_yourself_s[tensor])
        if bound != math.inf and self._own_seconds > 0:
            own = float(self.cold_bytes[tensor]) * self._own_seconds / self._own_bytes
            bound = min(bound, own)
        return bound

    def step(self, tensor: int, *, began: float, limit: float, waited: bool, now: float) -> Step:
        """What a reader of pending ``tensor`` does next. It asked at ``began``, gives up
        at ``limit`` (inf: never), and ``waited`` says whether a bounded wait has begun
        already. Re-asked on each wake-up: the plan (and with it the estimate) may come
        later. A tensor told ``"read"`` is remembered (see :meth:`took`)."""
        bound = self.bound(tensor)
        if bound < WORTH_WAITING_S and not waited:
            return self._read(tensor)  # sooner read than waited for (a begun wait ends below)
        if bound != math.inf and not waited:
            if self.daemon_slower(tensor, bound, now):
                return self._read(tensor)  # at the daemon's pace so far, it comes later
            waited = True
            if self.daemon_behind():
                return self._read(tensor)  # it has not been ahead of this rank: read now
        yours = began + bound
        if now >= min(yours, limit):
            if yours <= limit:
                self.waits.append(False)
                return self._read(tensor)
            return _TIMEOUT
        return Step("wait", until=min(yours, limit), bounded=waited)

    def warm_in_time(self) -> None:
        """A bounded wait ended with the tensor warm."""
        self.waits.append(True)

    def _read(self, tensor: int) -> Step:
        self._told[tensor] = 1.0
        return _READ

    def told(self, tensor: int) -> bool:
        """Whether the rank was told to read ``tensor`` itself and has not timed it yet."""
        return tensor in self._told

    def hinted(self, tensor: int, cold: float) -> None:
        """As its read began, ``cold`` of ``tensor``'s pages were not in the page cache."""
        if tensor in self._told:
            self._told[tensor] = cold

    def daemon_slower(self, tensor: int, bound: float, now: float) -> bool:
        """Whether, at the pace the daemon has brought this request's tensors so far,
        ``tensor``'s cold bytes would take it longer than ``bound``, this rank's own read
        of them. Then the rank reads now, beside the daemon's reads, and does not wait
        first: on storage the daemon's parallel reads do not outrun one stream by much (a
        local disk), the two together bring more than the daemon alone, and a wait that
        ends with the rank reading costs both. Where they do (a network mount), the
        daemon brings tensors many times faster than a rank reads one, and ranks wait.
        The pace counts from the daemon's first tensor of the request on (that tensor's
        bytes not counted): the first reads' latency, or other requests ahead of this
        one, would make it look slower than it is. A tensor the daemon is already reading
        is shared through the page cache either way."""
        since = self._delivering_since
        if since is None or self._delivered < DELIVERED_BYTES:
            return False
        rate = self._delivered / max(now - since, 1e-3)
        return bool(self.cold_bytes[tensor] > rate * bound)

    def daemon_behind(self) -> bool:
        """Whether, over this rank's last bounded waits, the daemon was too often not
        ahead: more than a quarter of them ended with the rank reading the tensor itself.
        Then waiting only adds to each read (on local disk the rank reads about as fast,
        and the page cache shares what both read), so the rank reads at once; one wait in
        four still goes ahead, so that a daemon which catches up is noticed."""
        if len(self.waits) < BEHIND_WINDOW // 2:
            return False
        behind = self.waits.count(False) * 4 > len(self.waits)
        if behind:
            self._skipped += 1
            if self._skipped % 4 == 0:
                return False  # this one waits: a sample of whether it is ahead again
        return behind

    # -- what happened -----------------------------------------------------------------

    def took(self, tensor: int, seconds: float) -> None:
        """The loader read ``tensor``, told to read it itself, in ``seconds``. Only the
        bytes the read itself brought in count (what the daemon brought already took the
        rank no storage time); once :data:`OWN_SAMPLES` reads of :data:`OWN_BYTES` are
        known, the last few bound each wait (:meth:`bound`)."""
        if tensor not in self._told or not seconds > 0:
            return
        cold = float(self.cold_bytes[tensor]) * self._told.pop(tensor)
        self._own_samples.append((int(cold), seconds))
        nbytes = sum(b for b, _ in self._own_samples)
        if len(self._own_samples) >= OWN_SAMPLES and nbytes >= OWN_BYTES:
            self._own_bytes = nbytes
            self._own_seconds = sum(t for _, t in self._own_samples)

    def warmed(self, tensors: Iterable[int], now: float) -> None:
        """The daemon reported ``tensors`` warm at ``now``: its pace (tensors this rank
        was told to read itself excepted: their pages come from its own reads)."""
        brought = [i for i in tensors if i not in self._told]
        if not brought:
            return
        if self._delivering_since is None:
            self._delivering_since = now  # the first: the pace starts here
        else:
            self._delivered += float(self.cold_bytes[brought].sum())


def read_times(
    rate: Any, file_index: Any, group_index: Any, nbytes: Any, cold_share: Any, tensors: int
) -> Any:
    """Per tensor, how long one stream of cold reads takes for its spans (``file_index``,
    ``group_index`` and ``nbytes`` per span) at ``rate`` (bytes/s per file; 0: unknown,
    and the tensor's time infinite), scaled by its ``cold_share``, and at least one read
    of the daemon's piece size on each of its files."""
    span_rate = rate[file_index]
    known = span_rate > 0
    per_span = np.full(len(nbytes), np.inf)
    np.divide(nbytes, span_rate, out=per_span, where=known)
    one_piece = np.full(len(nbytes), np.inf)
    np.divide(PIECE_BYTES, span_rate, out=one_piece, where=known)
    seconds = np.bincount(group_index, weights=per_span, minlength=tensors)
    seconds *= np.minimum(cold_share, 1.0)
    np.maximum.at(seconds, group_index, one_piece)
    return seconds


def plan_rates(plan: Sequence[tuple[str, float]], sent: Sequence[str]) -> Any:
    """Bytes/s per file as sent (0: unknown), from the plan's (path, one stream's rate)
    per file: in request order, unless a file had no plan."""
    positions = {path: i for i, path in enumerate(sent)}
    rate = np.zeros(len(sent))
    for j, (path, bytes_per_s) in enumerate(plan):
        i = j if len(plan) == len(sent) else positions.get(path)
        if i is not None:
            rate[i] = float(bytes_per_s)
    return rate
