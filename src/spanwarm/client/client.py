"""The rank side of the daemon protocol: ``Client.request_spans`` -> ``Ticket.wait``.

A request returns at once with a :class:`Ticket`; a background thread consumes the
daemon's stream and marks tensors ready as their bytes are warm. spanwarm must never
fail or stall a job: if the daemon is absent, dies, or answers with an error, one
warning is logged and every tensor not yet ready is released (the loader then reads
cold, as it would without spanwarm). ``SPANWARM_DISABLE=1`` makes every request a no-op.

The daemon warms only what this process proves it may read: before ``Warm``, the client
opens the request's files itself and passes the descriptors on the access channel
(:mod:`spanwarm.client.access`), which answers with a token the calls carry. A file this
process cannot open is not requested: its tensors are released at once (their load
would fail the same way without spanwarm). A socket in a place another user controls
is never contacted: one warning, and the load goes on without prefetch.

A daemon that is there but stuck must not stall the job either. The channel sends
keepalive pings (a frozen or partitioned daemon fails them within 15 s), and a
watchdog releases the ticket when ``stall_timeout`` (30 s) passes with no progress: no
event for this request's tensors and no movement in the node's heartbeats.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import grpc
import numpy as np

from spanwarm.client.access import AccessRefused, EndpointUnsafe, check_endpoint, grant
from spanwarm.client.inline_residency import TensorEnvelopes
from spanwarm.client.own_reads import OwnReads
from spanwarm.client.rank_spans import KeyMap, rank_spans
from spanwarm.client.residency_check import ResidencyCheck, distinct, resident_files
from spanwarm.conversions import Conversion
from spanwarm.endpoint import default_socket_path
from spanwarm.safetensors_header import Checkpoint, open_checkpoint
from spanwarm.tensor_layout import TensorSpans

__all__ = ["Client", "Progress", "Ticket", "message_dict"]

logger = logging.getLogger("spanwarm.client")

# _READ_FIRST: read by this rank before it was warm (reported with Ticket.consumed).
# _OWN: cold, but too little of the request is for asking to pay (see _WORTH_ASKING_S).
_PENDING, _READY, _FAILED, _RELEASED, _RESIDENT, _READ_FIRST, _OWN = 0, 1, 2, 3, 4, 5, 6
_MAX_MESSAGE = 128 * 2**20
_PIECE_BYTES = 2**20  # a read of the daemon's piece size (chunk/8): latency and all
# request() checks residency in line for about this long, while files are resident.
_INLINE_CHECK_S = 0.01
_BEHIND_WINDOW = 16  # bounded waits remembered (see Ticket._daemon_behind)
# A bounded wait shorter than this is not begun: a waiting thread wakes up to a GIL
# switch interval (5 ms) late while another thread of the rank runs Python, later still
# on a busy node (transformers' loader here: waits bounded at 1.3 ms took 2-37 ms). The
# rank reads at once instead; the page cache shares whatever the daemon reads meanwhile.
_WORTH_WAITING_S = 0.01
# A request the page cache holds but for an eighth at most, whose cold bytes this rank
# would read in less than this at the grant's rate of one stream, is not sent: the rank
# reads them itself. Asking costs about that much on the node's cores (the gRPC channel,
# the stream, the daemon's plan and events: 40-50 ms of CPU a rank here), and a few pages
# reclaimed here and there leave nothing a daemon could read much faster. On a slow
# mount (20 MB/s a stream) under 1 MB cold is kept back. A cold load goes out however
# small: it shows in `spanwarm status`, and other ranks and jobs share what it reads.
_WORTH_ASKING_S = 0.05
_WORTH_ASKING_SHARE = 8
_OWN_SAMPLES, _OWN_BYTES = 4, 4 * 2**20  # own cold reads timed before they bound waits
# How fast the daemon brings this request's tensors is known once it has brought this
# much (see Ticket._daemon_slower).
_DELIVERED_BYTES = 8 * 2**20
_REPORT_DELAY = 0.01  # consumption reports are batched over this many seconds
# Ping an idle connection every 10 s and give up on it 5 s after an unanswered ping: a
# SIGSTOPped or unreachable daemon ends the stream with UNAVAILABLE instead of never.
_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", _MAX_MESSAGE),
    ("grpc.max_receive_message_length", _MAX_MESSAGE),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.ping_timeout_ms", 5_000),  # the ack wait that applies here (default 60 s)
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]


@dataclass(frozen=True)
class Progress:
    groups: int
    ready: int
    """Tensors whose bytes the daemon has warmed."""
    failed: int
    """Tensors the daemon could not warm, or released without it (daemon absent or gone)."""
    bytes_total: int
    bytes_ready: int
    resident: int = 0
    """Tensors in the page cache when the request went out: read at once, not asked for."""
    read: int = 0
    """Tensors this rank read before they were warm (reading was sooner than waiting) and
    reported read: nothing waits for them, and the daemon stops warming them for this
    request where nothing the rank has not read shares their cells."""
    own: int = 0
    """Tensors not asked for though not resident: the request's cold bytes were so few
    that this rank reads them sooner than asking would cost (``_WORTH_ASKING_S``)."""

    @property
    def done(self) -> bool:
        return self.ready + self.failed + self.resident + self.read + self.own == self.groups


class Ticket:
    """Readiness of one request's tensors (checkpoint keys), updated by a background thread."""

    def __init__(self, names: Sequence[str], nbytes: Sequence[int]) -> None:
        self._index = {name: i for i, name in enumerate(names)}
        self._names = list(names)
        self._bytes = list(nbytes)
        self._state = [_PENDING] * len(names)
        self._pending = len(names)
        self._cond = threading.Condition()
        self._call: Any = None
        self._report: Any = None  # sends Consumed once the daemon has named the request
        self._request_id: int | None = None
        self._token = ""  # from the access channel: Consumed reports carry it
        self._unreported: list[int] = []
        self._flushing = False  # a batch of reports is due
        self._report_due = threading.Event()  # wakes _send_reports
        self._reporter: threading.Thread | None = None
        self.plan: list[dict[str, Any]] = []
        """The node plan for this request's files, once the daemon has accepted it."""
        self.failures: dict[str, str] = {}
        """Tensor -> why the daemon could not warm it."""
        self.finished = threading.Event()
        self._progress_at = time.monotonic()  # the last event that showed progress
        self._stalled = False  # released by the watchdog
        self._bytes_done = -1  # the node's counter in the last heartbeat
        self._spans: tuple[Any, Any, Any] | None = None  # (file, group, bytes) per span
        # Per tensor: whether it was in the page cache when the request went out, and
        # whether the full check has looked at it yet (None until it begins; see
        # residency_check); meanwhile, the loader looks a tensor up itself (_envelopes).
        self._resident: Any = None
        self._known: Any = None
        self._envelopes: TensorEnvelopes | None = None
        self._looked_up: set[int] = set()
        self._read_yourself_s = np.full(len(names), np.inf)  # see wait_for_read
        # Per tensor: what reading it here would fetch from storage. All of it, until the
        # residency check finds pages of it in the page cache already (residency_check):
        # a tensor missing a few pages is one short read away, not a whole cold one.
        self._cold_bytes = np.asarray(nbytes, dtype=np.float64).copy()
        self._granted_rate = 0.0  # the grant's stream_bytes_per_s
        # How the last bounded waits ended (True: warm in time), and waits skipped since.
        self._waits: collections.deque[bool] = collections.deque(maxlen=_BEHIND_WINDOW)
        self._skipped = 0
        # This rank's own reads of tensors that were not warm (see took): the last few.
        # Told to read it itself, not yet timed -> the share of it not in the page cache
        # as the read began (OwnReads.hint; 1.0 where not known).
        self._cold: dict[int, float] = {}
        self._own_samples: collections.deque[tuple[int, float]] = collections.deque(
            maxlen=_BEHIND_WINDOW
        )
        self._own_bytes = 0
        self._own_seconds = 0.0
        self._own_reads: OwnReads | None = None  # the spans to hint before such a read
        # What the daemon has brought since its first tensor of the request: cold bytes of
        # tensors it warmed (see _daemon_slower).
        self._delivering_since: float | None = None
        self._delivered = 0.0

    def wait(self, names: Iterable[str] | None = None, timeout: float | None = None) -> bool:
        """Block until these tensors (all, if None) are warm or released; False on timeout.

        Names the request did not include have nothing to wait for.
        """
        wanted = (
            list(range(len(self._names)))
            if names is None
            else [self._index[n] for n in names if n in self._index]
        )
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while any(self._state[i] == _PENDING for i in wanted):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def wait_for_read(self, name: str, timeout: float | None = None) -> str:
        """Wait before reading tensor ``name``, but no longer than reading it cold here would
        take: ``"ready"`` (warm, or released: read it now), ``"read"`` (not warm yet, and
        the rank would read it itself sooner: go ahead, the page cache shares whatever the
        daemon reads meanwhile) or ``"timeout"`` (not warm within ``timeout``).

        How long a cold read takes comes from the grant, then the plan: the daemon's
        learned throughput of one stream on each file's device, for this tensor's bytes,
        and at least one read of the daemon's piece size. A tensor resident when the
        request went out is read at once, and so is one that would be waited for less
        than ``_WORTH_WAITING_S``. Until the daemon has learned it, ranks wait as
        :meth:`wait` does. On fast local storage ranks thus never queue behind the daemon;
        on a slow mount, where the daemon's many reads in flight beat one stream, they wait.
        Once the daemon has brought 8 MiB of this request, a tensor it would bring later
        at that pace than the rank reads it is read at once, with no wait first (see
        :meth:`_daemon_slower`), and a rank whose waits too often end with it reading the
        tensor itself stops waiting (see :meth:`_daemon_behind`). Before ``"read"`` for a
        tensor that is not warm, the kernel is asked to start reading exactly its bytes
        (:mod:`.own_reads`): the loader's faults then wait for those pages instead of
        reading whole read-ahead windows around them.
        """
        i = self._index.get(name)
        if i is None:
            return "ready"
        if self.finished.is_set():  # every state is final: no lock, nothing to wait for
            return "read" if self._read_at_once(self._state[i], i) else "ready"
        outcome = self._wait_for_read(i, timeout)
        own_reads = self._own_reads  # once: the request may end (and drop it) meanwhile
        if outcome == "read" and i in self._cold and own_reads is not None:
            # Outside the lock: a busy device can hold the hint up, and the stream thread
            # must go on marking tensors ready meanwhile. (hint() raises nothing.)
            cold = own_reads.hint(i)
            if cold is not None:
                with self._cond:
                    if i in self._cold:
                        self._cold[i] = cold
        return outcome

    def _wait_for_read(self, i: int, timeout: float | None) -> str:
        start = time.monotonic()
        limit = np.inf if timeout is None else start + timeout
        waited = False  # a bounded wait began: how it ends goes into _waits
        while True:
            with self._cond:
                state = self._state[i]
                if self._read_at_once(state, i):
                    return "read"
                envelopes = self._envelopes
                if (
                    state == _PENDING
                    and envelopes is not None
                    and not self._known[i]
                    and i not in self._looked_up
                ):
                    self._looked_up.add(i)  # once; then as the full check finds it
                else:
                    envelopes = None
                    if state != _PENDING:
                        if waited and state == _READY:
                            self._waits.append(True)
                        return "ready"
                    # Re-read each time: the plan (and with it this estimate) may come later.
                    bound = float(self._read_yourself_s[i])
                    if bound != np.inf and self._own_seconds > 0:
                        # What this rank's own cold reads took (Ticket.took), where lower.
                        own = self._cold_bytes[i] * self._own_seconds / self._own_bytes
                        bound = min(bound, own)
                    if bound < _WORTH_WAITING_S and not waited:
                        self._cold[i] = 1.0
                        return "read"  # sooner read than waited for (a begun wait ends below)
                    if bound != np.inf and not waited:
                        if self._daemon_slower(i, bound):
                            self._cold[i] = 1.0
                            return "read"  # at the daemon's pace so far, it comes later
                        waited = True
                        if self._daemon_behind():
                            self._cold[i] = 1.0
                            return "read"  # it has not been ahead of this rank: read now
                    yours = start + bound
                    now = time.monotonic()
                    if now >= min(yours, limit):
                        if yours <= limit:
                            self._waits.append(False)
                            self._cold[i] = 1.0
                            return "read"
                        return "timeout"
                    until = min(yours, limit)
                    self._cond.wait(None if until == np.inf else until - now)
            if envelopes is not None and envelopes.cached(i, lambda: self._cached(i)):
                return "read"  # its file's turn in the full check has not come yet

    def _read_at_once(self, state: int, i: int) -> bool:
        """Tensor ``i`` is read now, not waited for: it was in the page cache when the
        request went out (and not warmed since), or so little was cold that it was never
        asked for."""
        resident = self._resident
        return state == _OWN or (state != _READY and resident is not None and bool(resident[i]))

    def _look_up_from(self, envelopes: TensorEnvelopes | None) -> Any:
        """The residency check begins (the loader may look tensors up in ``envelopes``
        meanwhile; a loader waiting already does so now), or, with None, is over;
        returns the per-tensor resident flags the check fills in."""
        with self._cond:
            if envelopes is not None:
                self._resident = np.zeros(len(self._names), dtype=bool)
                self._known = np.zeros(len(self._names), dtype=bool)
            self._envelopes = envelopes
            self._cond.notify_all()
            return self._resident

    def _looked_at(self, known: Any, missing: Any, resident: Any) -> None:
        """The check has looked at every envelope of tensors ``known`` (``missing``
        bytes of each, or more): those of them in ``resident`` are read at once."""
        with self._cond:
            self._cold_bytes[known] = np.minimum(self._cold_bytes[known], missing)
            self._known[known] = True
            if resident.size:
                self._resident[resident] = True
                # In the same step (the condition's lock is re-entrant): no reader sees a
                # tensor resident but still pending.
                self._mark(resident.tolist(), _RESIDENT)

    def _resident_throughout(self) -> None:
        """Every tensor was found in the page cache before the request went out: each is
        read at once, none asked for (what the full check and a release leave, without
        the check)."""
        with self._cond:
            names = len(self._names)
            self._resident = np.ones(names, dtype=bool)
            self._known = np.ones(names, dtype=bool)
            self._cold_bytes[:] = 0.0
            self._mark(range(names), _RESIDENT)
        self._release()

    def _cached(self, i: int) -> None:
        """Tensor ``i`` was found wholly in the page cache on the loader's thread."""
        with self._cond:
            if self._state[i] == _PENDING and self._resident is not None:
                self._resident[i] = True
                self._cold_bytes[i] = 0.0
                self._mark([i], _RESIDENT)

    def took(self, name: str, seconds: float) -> None:
        """How long the loader took to read ``name`` here after :meth:`wait_for_read` told
        it to read a tensor that was not warm. Once a few MiB of such reads are known, each
        wait is bounded by this rank's own rate as well: the daemon's figure is one of its
        streams among many, far below what a rank gets where the storage is fast. (Only
        ever lower: using the rank's own rate where it is slower, too, did not change
        the emulated cross-region loads, measured, and one request's reads of a slow
        mount would lengthen its waits on a fast one.) Only the tensor's share not in the
        page cache as the read began counts as read (:meth:`OwnReads.hint`)."""
        i = self._index.get(name)
        if i is None or i not in self._cold:
            return  # as below, without the lock: a resident load calls this per tensor
        with self._cond:
            if i not in self._cold or not seconds > 0:
                return
            # Only the bytes the read itself brought in: what the daemon brought already
            # (or was bringing) took the rank no storage time.
            cold = self._cold_bytes[i] * self._cold.pop(i)
            self._own_samples.append((int(cold), seconds))
            nbytes = sum(b for b, _ in self._own_samples)
            if len(self._own_samples) >= _OWN_SAMPLES and nbytes >= _OWN_BYTES:
                self._own_bytes = nbytes
                self._own_seconds = sum(t for _, t in self._own_samples)

    def _daemon_slower(self, i: int, bound: float) -> bool:
        """Whether, at the pace the daemon has brought this request's tensors so far,
        tensor ``i``'s cold bytes would take it longer than ``bound``, this
        rank's own read of them. Then the rank reads now, beside the daemon's reads, and
        does not wait first: on storage the daemon's parallel reads do not outrun one
        stream by much (a local disk), the two together bring more than the daemon alone,
        and a wait that ends with the rank reading costs both. Where they do (a network
        mount), the daemon brings tensors many times faster than a rank reads one, and
        ranks wait as before. The pace counts from the daemon's first tensor of the
        request on (that tensor's bytes not counted): the first reads' latency, or other
        requests ahead of this one, would make it look slower than it is. A tensor the
        daemon is already reading is shared through the page cache either way. (Caller
        holds the lock.)"""
        since = self._delivering_since
        if since is None or self._delivered < _DELIVERED_BYTES:
            return False
        rate = self._delivered / max(time.monotonic() - since, 1e-3)
        return bool(self._cold_bytes[i] > rate * bound)

    def _daemon_behind(self) -> bool:
        """Whether, over this rank's last bounded waits, the daemon was too often not
        ahead: more than a quarter of them ended with the rank reading the tensor itself.
        Then waiting only adds to each read (on local disk the rank reads about as fast,
        and the page cache shares what both read), so the rank reads at once; one wait in
        four still goes ahead, so that a daemon which catches up is noticed."""
        if len(self._waits) < _BEHIND_WINDOW // 2:
            return False
        behind = self._waits.count(False) * 4 > len(self._waits)
        if behind:
            self._skipped += 1
            if self._skipped % 4 == 0:
                return False  # this one waits: a sample of whether it is ahead again
        return behind

    def ready(self, name: str) -> bool:
        """True when ``name`` is warm, was resident when the request went out (read it
        now; a few pages of it may be missing, see :mod:`.residency_check`), was reported read
        (:meth:`consumed`) before it was warm, was released, was left to this rank to read
        (``progress.own``), or is not part of the request."""
        i = self._index.get(name)
        return i is None or self._state[i] != _PENDING

    @property
    def progress(self) -> Progress:
        with self._cond:
            ready = [i for i, s in enumerate(self._state) if s == _READY]
            return Progress(
                groups=len(self._names),
                ready=len(ready),
                failed=sum(1 for s in self._state if s in (_FAILED, _RELEASED)),
                bytes_total=sum(self._bytes),
                bytes_ready=sum(self._bytes[i] for i in ready),
                resident=sum(1 for s in self._state if s == _RESIDENT),
                read=sum(1 for s in self._state if s == _READ_FIRST),
                own=sum(1 for s in self._state if s == _OWN),
            )

    def consumed(self, names: Iterable[str]) -> None:
        """Tell the daemon these tensors have been read: under a memory budget, warming
        moves on to the next ones, and one read before it was warm is no longer waited for
        (it counts in ``progress.read``) nor warmed for this request, unless tensors not
        yet read share its cells. Returns at once: reports go out in batches, at most
        ``_REPORT_DELAY`` later (a loader of many small tensors would otherwise spend a
        gRPC call on each, on cores the load needs)."""
        if self.finished.is_set():
            return  # as below, without the lock: a resident load calls this per tensor
        with self._cond:
            if self.finished.is_set():
                return  # the stream is over, or never began: no request to tell
            groups = [
                i
                for i in (self._index.get(n) for n in names)
                if i is not None and self._state[i] not in (_RESIDENT, _OWN)  # never asked for
            ]
            self._unreported.extend(groups)
            read_first = [i for i in groups if self._state[i] == _PENDING]
            due = not (self._request_id is None or self._report is None or self._flushing)
            if due:  # else sent once the plan arrives, or with the batch already due
                self._flushing = True
                if self._reporter is None:  # one thread per load, not one per batch
                    self._reporter = threading.Thread(
                        target=self._send_reports, name="spanwarm-reports", daemon=True
                    )
                    self._reporter.start()
        if read_first:  # outside the lock: marking the last pending one closes descriptors
            self._mark(read_first, _READ_FIRST, progress=False)
        if due:
            self._report_due.set()

    def _send_reports(self) -> None:
        """Send each batch ``_REPORT_DELAY`` after its first report, until the load ends."""
        while True:
            self._report_due.wait()
            if self.finished.is_set():
                return  # the stream is over: reports would find no request
            time.sleep(_REPORT_DELAY)
            self._report_due.clear()
            if self.finished.is_set():
                # Released during the sleep: its wake-up was just cleared, and no other
                # comes (the thread waited for good, holding the ticket).
                return
            self._flush()

    def _flush(self, wait: bool = False) -> None:
        with self._cond:
            self._flushing = False
            batch, self._unreported = self._unreported, []
            request_id, report = self._request_id, self._report
        if batch and request_id is not None and report is not None:
            try:
                sent = report(request_id, batch)
                if wait:
                    sent.result(timeout=1.0)
            except Exception as exc:  # the client was closed, the channel is gone: moot
                logger.debug("spanwarm: Consumed not sent: %s", exc)

    def cancel(self) -> None:
        """Withdraw the request: the daemon drops warming only it needed. Reads reported
        and not yet sent go first (and are waited for, briefly): ended, the request could
        not take them, and ``--evict-after-read`` would keep what they read."""
        self._flush(wait=True)
        if self._call is not None:
            self._call.cancel()
        self._release()

    def _release_stalled(self) -> int:
        """The watchdog gave up on the daemon: cancel the stream, release what is pending."""
        self._stalled = True
        if self._call is not None:
            self._call.cancel()
        return self._release()

    # -- updated by the stream thread --------------------------------------------------

    def _learn_read_times(self, files: list[Any], sent: list[str]) -> None:
        """From the plan: per tensor, how long one stream of cold reads would take for its
        bytes on their devices, and at least one read of the daemon's piece size there
        (infinite where the daemon has not learned a device yet)."""
        positions = {path: i for i, path in enumerate(sent)}
        rate = np.zeros(len(sent))
        for j, plan in enumerate(files):  # in request order, unless a file had no plan
            i = j if len(files) == len(sent) else positions.get(plan.path)
            if i is not None:
                rate[i] = float(plan.stream_bytes_per_s)
        self._set_read_times(rate, last=True)

    def _set_read_times(self, rate: Any, *, last: bool) -> None:
        """Read times from ``rate`` (bytes/s per file as sent; 0: unknown). The grant gives
        a first figure (the slowest mount's), the plan the last one, per file."""
        if self._spans is None:
            return
        file_index, group_index, nbytes = self._spans
        if last:
            self._spans = None  # a million spans' columns are not kept for the load
        span_rate = rate[file_index]
        known = span_rate > 0
        per_span = np.full(len(nbytes), np.inf)
        np.divide(nbytes, span_rate, out=per_span, where=known)
        one_piece = np.full(len(nbytes), np.inf)
        np.divide(_PIECE_BYTES, span_rate, out=one_piece, where=known)
        seconds = np.bincount(group_index, weights=per_span, minlength=len(self._names))
        with self._cond:  # only the cold part of a partly resident tensor is read
            total = np.asarray(self._bytes, dtype=np.float64)
            cold = np.divide(self._cold_bytes, total, out=np.ones_like(total), where=total > 0)
        seconds *= np.minimum(cold, 1.0)
        np.maximum.at(seconds, group_index, one_piece)
        with self._cond:
            self._read_yourself_s = seconds
            self._cond.notify_all()  # waiters re-read their limit

    def _progressed(self) -> None:
        with self._cond:
            self._progress_at = time.monotonic()

    def _heartbeat(self, bytes_done: int) -> None:
        """A heartbeat is progress when the node got somewhere since the last one."""
        with self._cond:
            if bytes_done != self._bytes_done:
                self._bytes_done = bytes_done
                self._progress_at = time.monotonic()

    def _stalled_for(self) -> float:
        """Seconds since the last progress while tensors are pending (0 when none are)."""
        with self._cond:
            return time.monotonic() - self._progress_at if self._pending else 0.0

    def _mark(
        self, groups: Iterable[int], state: int, reason: str = "", *, progress: bool = True
    ) -> None:
        """Move pending groups to ``state``; ``progress``: the daemon's (the watchdog's
        measure), not the rank's own reads."""
        with self._cond:
            if progress:
                self._progress_at = time.monotonic()
            states, n = self._state, len(self._state)
            # Warmed by the daemon, for its pace (_daemon_slower): not tensors this rank
            # was told to read itself (their pages come from its own reads).
            brought: list[int] = []
            for i in groups:
                if 0 <= i < n and states[i] == _PENDING:
                    states[i] = state
                    self._pending -= 1
                    if reason:
                        self.failures[self._names[i]] = reason
                    if state == _READY and i not in self._cold:
                        brought.append(i)
            if brought and self._delivering_since is None:
                self._delivering_since = time.monotonic()  # the first: the pace starts here
            elif brought:
                self._delivered += float(self._cold_bytes[brought].sum())
            self._cond.notify_all()
            own_reads = None
            if not self._pending:  # nothing left to read cold: no more hints
                own_reads, self._own_reads = self._own_reads, None
        if own_reads is not None:
            own_reads.close()

    def _keep_own_reads(self, own_reads: OwnReads | None) -> None:
        """Hint this request's cold reads from now on (not once nothing is pending)."""
        with self._cond:
            if self._pending and not self.finished.is_set():
                self._own_reads, own_reads = own_reads, None
        if own_reads is not None:
            own_reads.close()

    def _release(self) -> int:
        """Everything still pending is released to be read cold; returns how many."""
        with self._cond:
            released = self._pending
            self._state = [_RELEASED if s == _PENDING else s for s in self._state]
            self._pending = 0
            self._cond.notify_all()
            own_reads, self._own_reads = self._own_reads, None
            self.finished.set()  # under the lock: _consume sets _own_reads only before it
        self._report_due.set()  # the reporting thread, if any, ends
        if own_reads is not None:
            own_reads.close()
        return released


def _job_id(job: str | None) -> str:
    return (
        job or os.environ.get("SPANWARM_JOB") or os.environ.get("TORCHELASTIC_RUN_ID") or "default"
    )


def _rank() -> int:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    except ImportError:
        pass
    return int(os.environ.get("RANK", "0"))


def disabled_by_environment() -> bool:
    """``SPANWARM_DISABLE`` set (and not 0): every request is a no-op."""
    return os.environ.get("SPANWARM_DISABLE", "") not in ("", "0")


class Client:
    """A connection to the node's daemon (lazily opened; safe to share across threads)."""

    def __init__(
        self,
        socket: str | None = None,
        timeout: float = 10.0,
        *,
        stream_timeout: float = 6 * 3600,
        stall_timeout: float = 30.0,
        read_yourself: bool = True,
    ) -> None:
        if not stall_timeout > 0:
            raise ValueError(f"stall_timeout: must be > 0 seconds, got {stall_timeout!r}")
        self.socket = socket or default_socket_path()
        self.timeout = timeout
        self.stream_timeout = stream_timeout
        self.stall_timeout = stall_timeout
        """Release a ticket whose daemon shows no progress for this long (seconds)."""
        self.read_yourself = read_yourself
        """``Ticket.wait_for_read`` stops waiting once reading a tensor here would be sooner,
        and tensors resident when a request goes out are read at once and not asked for
        (False: every tensor goes to the daemon and ``wait_for_read`` waits like ``wait``,
        e.g. to see every tensor warmed by the daemon, or to have ``--hold`` pin it)."""
        self.disabled = disabled_by_environment()
        self._channel: grpc.Channel | None = None
        self._lock = threading.Lock()
        self._status_token = ("", 0.0)  # (token, reuse it until this monotonic time)

    def _stub(self) -> Any:
        from spanwarm.rpc.v1 import warmer_pb2_grpc

        with self._lock:
            if self._channel is None:
                check_endpoint(self.socket)  # before a single byte goes to it
                self._channel = grpc.insecure_channel(
                    f"unix:{self.socket}", options=_CHANNEL_OPTIONS
                )
            return warmer_pb2_grpc.WarmerStub(self._channel)

    def close(self) -> None:
        with self._lock:
            if self._channel is not None:
                self._channel.close()
                self._channel = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request_spans(
        self,
        state_dict: Mapping[str, Any],
        checkpoint: Any,
        *,
        job: str | None = None,
        key_map: KeyMap | None = None,
        conversions: Sequence[Conversion] = (),
        unmatched: Literal["warm", "skip"] = "warm",
    ) -> Ticket:
        """Ask the daemon to warm what this rank will read of ``checkpoint`` (safetensors
        files, sliced with ``get_slice``: each sliced tensor's first page is asked for too,
        see :mod:`.first_pages`); returns at once."""
        if self.disabled:
            return self._released([])
        try:
            ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else open_checkpoint(checkpoint)
            spans = rank_spans(
                state_dict,
                ckpt,
                key_map=key_map,
                conversions=conversions,
                unmatched=unmatched,
                first_pages=True,
            )
        except Exception as exc:  # a prefetch problem must never fail the load
            logger.warning("spanwarm: cannot compute spans (%s); loading without prefetch", exc)
            return self._released([])
        return self.request(spans, job=job)

    def request(
        self, spans: Sequence[TensorSpans], *, job: str | None = None, rank: int | None = None
    ) -> Ticket:
        """Ask the daemon to warm ``spans`` (grouped by their tensor); returns at once."""
        spans = spans if isinstance(spans, (list, tuple)) else list(spans)  # read twice
        files: dict[str, int] = {}
        groups: dict[str, int] = {}
        nbytes: list[int] = []
        file_index: list[int] = []
        group_index: list[int] = []
        absolute: dict[str, int] = {}  # as given -> file number (a few files, many spans)
        envelopes: dict[tuple[int, int], list[int]] = {}  # (file, tensor) -> first, end
        for s in spans:
            f = absolute.get(s.path, -1)
            if f < 0:
                f = absolute[s.path] = files.setdefault(os.path.abspath(s.path), len(files))
            g = groups.setdefault(s.tensor, len(groups))
            if g == len(nbytes):
                nbytes.append(0)
            nbytes[g] += s.length * s.count
            file_index.append(f)
            group_index.append(g)
            end = s.offset + s.length
            if s.count > 1:
                end += (s.count - 1) * s.stride
            box = envelopes.get((f, g))
            if box is None:
                envelopes[(f, g)] = [s.offset, end]
            else:
                box[0] = min(box[0], s.offset)
                box[1] = max(box[1], end)
        ticket = Ticket(list(groups), nbytes)
        if self.disabled:
            ticket._release()
            return ticket
        check = None
        if self.read_yourself:
            # In line while the files are resident, for up to about 10 ms: a resident
            # checkpoint is found so in 1-2 ms, with no thread to hand the loader's first
            # tensors over (a second thread of the rank's interpreter wins the GIL back
            # after each of its system calls: the loader waited 2-6 ms for its first
            # tensor behind that check). First in plain ints (resident_files: nothing
            # else to build where every file is resident), then, from the first file
            # that is not, with the full check's counts; the rest goes on the ticket's
            # thread.
            began = time.monotonic()
            try:
                per_file: list[tuple[list[int], list[int]]] = [([], []) for _ in files]
                for (f, _), (first, end) in envelopes.items():
                    per_file[f][0].append(first)
                    per_file[f][1].append(end)
                paths = list(files)
                settled = resident_files(paths, per_file, budget_s=_INLINE_CHECK_S)
                if settled == len(paths) and groups:
                    ticket._resident_throughout()
                    return self._answered_in_line(ticket)
                collected = _Spans.collect(paths, file_index, group_index, spans)
                check = ResidencyCheck(ticket, collected, settled=settled)
                left = _INLINE_CHECK_S - (time.monotonic() - began)
                everything = check.run(budget_s=max(left, 0.0)) and check.resident.all()
            except Exception as exc:  # a prefetch problem must never fail the load
                logger.warning("spanwarm: %s; loading without prefetch", exc)
                if check is not None:
                    check.close()
                ticket._release()
                return ticket
            if everything and groups:
                check.close()
                ticket._release()  # every tensor resident (some within their slack)
                return self._answered_in_line(ticket)
        else:
            collected = _Spans.collect(list(files), file_index, group_index, spans)
        header = {"job": _job_id(job), "rank": _rank() if rank is None else rank}
        thread = threading.Thread(
            target=self._consume,
            args=(ticket, collected, header, check),
            name="spanwarm-ticket",
            daemon=True,
        )
        thread.start()
        return ticket

    def _answered_in_line(self, ticket: Ticket) -> Ticket:
        """``ticket``, every tensor of it resident: nothing to ask for, no thread. A few
        stats, though: an operator still hears of a missing or unsafe daemon."""
        try:
            check_endpoint(self.socket)
        except (EndpointUnsafe, OSError) as exc:
            self._warn_unreachable(exc)
        return ticket

    def _watch(self, ticket: Ticket) -> None:
        """Release the ticket when the daemon makes no progress for ``stall_timeout``."""
        while not ticket.finished.wait(min(0.5, self.stall_timeout / 8)):
            stalled = ticket._stalled_for()
            if stalled < self.stall_timeout:
                continue
            released = ticket._release_stalled()
            if released:
                logger.warning(
                    "spanwarm: daemon at %s made no progress for %.0f s; %d tensors load "
                    "without prefetch",
                    self.socket,
                    stalled,
                    released,
                )
            return

    def _begin(self, ticket: Ticket) -> None:
        """The watchdog (started here, not by request(): starting a thread waits for it to
        run, and the loader's thread has better things to do), before anything that may
        hang (a frozen mount under the rest of the residency check; the part request()
        does in line opens files the loader is about to open itself, and would hang it
        the same way); then the socket's check: no daemon, or not one to trust, releases
        the ticket at once."""
        threading.Thread(
            target=self._watch, args=(ticket,), name="spanwarm-watchdog", daemon=True
        ).start()
        check_endpoint(self.socket)

    def _warn_unreachable(self, exc: EndpointUnsafe | OSError) -> None:
        if isinstance(exc, EndpointUnsafe):
            logger.warning(
                "spanwarm: not using the daemon socket %s: %s; loading without prefetch",
                self.socket,
                exc,
            )
        else:
            logger.warning(
                "spanwarm: daemon at %s: UNAVAILABLE: %s; loading without prefetch",
                self.socket,
                exc.strerror or exc,
            )

    def _consume(
        self,
        ticket: Ticket,
        spans: _Spans,
        header: dict[str, Any],
        check: ResidencyCheck | None,
    ) -> None:
        from spanwarm.rpc.v1 import warmer_pb2

        try:
            if self.read_yourself:
                # Before anything else: the loader reads its first tensors itself while the
                # request is being built and proved, and each of those reads unhinted is a
                # fault reading a whole read-ahead window (and leaving marks that read
                # more), 8-16 MiB for a slice of one.
                ticket._keep_own_reads(OwnReads.of(spans))
            # First, before the grant and the plan: a rank reads the tensors resident
            # already at once instead of waiting for the daemon's answer, and asks only
            # for the others. Nothing could make those sooner, and the daemon's work for
            # them (grant, admission, events, reports) would take CPU from the load on
            # the node's cores; where every tensor is resident, nothing goes out at all.
            # The loader may look tensors up itself from the check's first step on.
            if check is None:
                self._begin(ticket)
            else:
                try:
                    self._begin(ticket)
                    check.run()
                finally:
                    check.close()
                kept = spans.kept(~check.resident[spans.group_index])
                if kept is None:
                    return
                spans = kept
            request = warmer_pb2.WarmRequest(groups=ticket._names, **header)
            request = self._prove(ticket, spans.into(request))
            if request is None or ticket.finished.is_set():  # cancelled or released meanwhile
                return
            if self.read_yourself and _not_worth_asking(ticket, request):
                return
            if self.read_yourself:  # as sent: _prove renumbers files when one would not open
                _index_read_bytes(ticket, request)
                # The slowest mount's rate, from the grant: waits are bounded from now on,
                # not only once the plan comes.
                rate = np.full(len(request.files), ticket._granted_rate)
                ticket._set_read_times(rate, last=False)
            call = self._stub().Warm(request, timeout=self.stream_timeout)
            ticket._call = call
            if ticket.finished.is_set():  # cancel() or the watchdog ran before _call was set
                call.cancel()
            for event in call:
                kind = event.WhichOneof("event")
                if kind == "heartbeat":
                    ticket._heartbeat(event.heartbeat.bytes_done)
                elif kind == "plan":
                    ticket._progressed()
                    ticket.plan = [message_dict(f) for f in event.plan.files]
                    if self.read_yourself:
                        ticket._learn_read_times(list(event.plan.files), list(request.files))
                    self._attach(ticket, event.plan.request_id)
                elif kind == "ready":
                    ticket._mark(event.ready.groups, _READY)
                elif kind == "failed":
                    ticket._mark(
                        event.failed.groups, _FAILED, f"{event.failed.code}: {event.failed.reason}"
                    )
                # After "done" the daemon keeps the stream open until this rank has
                # reported (Ticket.consumed) what it holds; the loop ends with the stream.
            with ticket._cond:
                pending = sum(state == _PENDING for state in ticket._state)
            if pending and not ticket.finished.is_set():  # ended by the daemon, not us
                logger.warning(
                    "spanwarm: daemon at %s ended the stream with %d tensors not warm; they "
                    "load without prefetch",
                    self.socket,
                    pending,
                )
        except (EndpointUnsafe, OSError) as exc:
            self._warn_unreachable(exc)
        except AccessRefused as exc:
            logger.warning(
                "spanwarm: daemon at %s refused the files: %s; loading without prefetch",
                self.socket,
                exc,
            )
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED and not ticket._stalled:
                logger.warning(
                    "spanwarm: daemon at %s: %s: %s; the rest loads without prefetch",
                    self.socket,
                    exc.code().name,
                    exc.details(),
                )
        except Exception as exc:  # a prefetch problem must never fail the load
            logger.warning("spanwarm: %s; the rest loads without prefetch", exc)
        finally:
            if ticket.failures:
                name, reason = next(iter(ticket.failures.items()))
                logger.warning(
                    "spanwarm: %d tensors could not be warmed (first: %s: %s)",
                    len(ticket.failures),
                    name,
                    reason,
                )
            ticket._release()

    def _prove(self, ticket: Ticket, request: Any) -> Any:
        """Pass the request's files to the daemon and return the request with its token,
        naming only the files this process could open (None: nothing is left to warm).
        Groups with a byte in a file that would not open are released now."""
        granted = grant(self.socket, list(request.files), timeout=self.timeout)
        request.token = granted.token
        ticket._token = granted.token
        ticket._granted_rate = granted.stream_bytes_per_s
        if not granted.failures:
            return request
        file_index = np.asarray(request.file_index, dtype=np.int64)
        group_index = np.asarray(request.group_index, dtype=np.int64)
        for position, reason in granted.failures.items():
            groups = distinct(group_index[file_index == position])
            ticket._mark(groups.tolist(), _FAILED, f"NOT_REQUESTED: {reason}")
        return _select_spans(request, ~np.isin(file_index, list(granted.failures)))

    def _attach(self, ticket: Ticket, request_id: int) -> None:
        """Give the ticket its request id and a way to report consumption."""
        from spanwarm.rpc.v1 import warmer_pb2

        stub = self._stub()
        token = ticket._token

        def report(request_id: int, groups: list[int]) -> Any:
            # Fire and forget: the loader must not wait for the daemon between tensors.
            future = stub.Consumed.future(
                warmer_pb2.ConsumedRequest(request_id=request_id, groups=groups, token=token),
                timeout=self.timeout,
            )
            future.add_done_callback(_log_consumed_error)
            return future

        with ticket._cond:
            ticket._request_id, ticket._report = request_id, report
            backlog, ticket._unreported = ticket._unreported, []
        if backlog:
            report(request_id, backlog)

    def status(self) -> dict[str, Any]:
        """The daemon's Status as a dict: this uid's own ranks and files, and the node's
        totals (everything, for root and the daemon's own user). Raises grpc.RpcError
        when it is unreachable, EndpointUnsafe when its socket cannot be trusted."""
        from spanwarm.rpc.v1 import warmer_pb2

        stub = self._stub()
        now = time.monotonic()
        if now >= self._status_token[1]:
            try:  # a grant of no files proves who we are (kept for half its life)
                granted = grant(self.socket, [], timeout=self.timeout)
                self._status_token = (granted.token, now + granted.expires_s / 2)
            except (OSError, AccessRefused) as exc:
                logger.debug("spanwarm: no token for Status (%s): node totals only", exc)
                self._status_token = ("", now)
        request = warmer_pb2.StatusRequest(token=self._status_token[0])
        return message_dict(stub.Status(request, timeout=self.timeout))

    def _released(self, names: list[str]) -> Ticket:
        ticket = Ticket(names, [0] * len(names))
        ticket._release()
        return ticket


_COLUMNS = ("file_index", "offset", "length", "stride", "count", "group_index")


@dataclass
class _Spans:
    """A request's spans as columns, named as WarmRequest's fields: what ``request``
    collects on the loader's thread, and the request is built from on the ticket's, once
    the residency check has said which tensors to leave out."""

    files: list[str]
    file_index: Any
    offset: Any
    length: Any
    stride: Any
    count: Any
    group_index: Any

    @classmethod
    def collect(
        cls, files: list[str], file_index: list[int], group_index: list[int], spans: Any
    ) -> _Spans:
        """Of ``request()``'s spans, numbered there by file and tensor: only once a request
        may go out (a resident load builds none; the WarmRequest itself is built on the
        ticket's thread, of the spans the residency check leaves)."""
        return cls(
            files,
            np.asarray(file_index, dtype=np.int64),
            np.fromiter((s.offset for s in spans), dtype=np.int64, count=len(spans)),
            np.fromiter((s.length for s in spans), dtype=np.int64, count=len(spans)),
            np.fromiter((s.stride for s in spans), dtype=np.int64, count=len(spans)),
            np.fromiter((s.count for s in spans), dtype=np.int64, count=len(spans)),
            np.asarray(group_index, dtype=np.int64),
        )

    @classmethod
    def of(cls, request: Any) -> _Spans:
        columns = (np.asarray(getattr(request, name), dtype=np.int64) for name in _COLUMNS)
        return cls(list(request.files), *columns)

    def kept(self, keep: Any) -> _Spans | None:
        """Only the spans where ``keep`` is set, and only the files those name
        (renumbered); None when no span is left. Groups keep their numbers: the ticket's
        and the daemon's events name them so."""
        if keep.all():
            return self
        if not keep.any():
            return None
        file_index = self.file_index[keep]
        used = distinct(file_index)
        renumber = np.full(len(self.files), -1, dtype=np.int64)
        renumber[used] = np.arange(len(used))
        columns = (getattr(self, name)[keep] for name in _COLUMNS[1:])
        return _Spans([self.files[i] for i in used.tolist()], renumber[file_index], *columns)

    def into(self, request: Any) -> Any:
        """``request`` (a WarmRequest) with these spans in place of its own."""
        del request.files[:]
        request.files.extend(self.files)
        for name in _COLUMNS:
            del getattr(request, name)[:]
            getattr(request, name).extend(getattr(self, name).tolist())
        return request


def _select_spans(request: Any, keep: Any) -> Any:
    """``request`` with only the spans where ``keep`` is set (see :meth:`_Spans.kept`);
    None when no span is left."""
    if keep.all():
        return request
    kept = _Spans.of(request).kept(keep)
    return None if kept is None else kept.into(request)


def _not_worth_asking(ticket: Ticket, request: Any) -> bool:
    """Whether this rank reads what ``request`` names sooner than asking would cost: its
    cold bytes (what the residency check found missing) are at most an eighth of the
    ticket's and at the grant's rate of one stream take under ``_WORTH_ASKING_S``. If so
    its tensors are marked ``_OWN``."""
    rate = ticket._granted_rate
    if not rate > 0:
        return False  # nothing learned about the mount yet: ask
    groups = distinct(np.asarray(request.group_index, dtype=np.int64))
    with ticket._cond:
        cold = float(ticket._cold_bytes[groups].sum())
    if cold * _WORTH_ASKING_SHARE > sum(ticket._bytes) or cold / rate >= _WORTH_ASKING_S:
        return False
    ticket._mark(groups.tolist(), _OWN, progress=False)
    return True


def _index_read_bytes(ticket: Ticket, request: Any) -> None:
    """Bytes per span and where they are, as sent (for ``Ticket._learn_read_times``)."""
    nbytes = np.asarray(request.length, dtype=np.float64) * np.asarray(request.count)
    ticket._spans = (
        np.asarray(request.file_index, dtype=np.int64),
        np.asarray(request.group_index, dtype=np.int64),
        nbytes,
    )


def _log_consumed_error(future: Any) -> None:
    if future.exception() is not None:  # the request already ended: nothing to release
        logger.debug("spanwarm: Consumed: %s", future.exception())


def message_dict(message: Any) -> dict[str, Any]:
    """A protobuf message as plain Python values (numbers stay numbers, unlike MessageToDict)."""
    out: dict[str, Any] = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        nested = field.message_type is not None
        if field.is_repeated:
            out[field.name] = [message_dict(v) for v in value] if nested else list(value)
        else:
            out[field.name] = message_dict(value) if nested else value
    return out
