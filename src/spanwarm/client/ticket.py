"""Readiness of one request's tensors: what a loader waits on before each read.

A :class:`Ticket` is the meeting point of the threads of one request. The loader's
thread waits on it (:meth:`Ticket.wait`, :meth:`Ticket.wait_for_read`) and reports reads
(:meth:`Ticket.consumed`, :meth:`Ticket.took`); the ticket's thread (started by
:meth:`spanwarm.client.Client.request`) settles tensors from the residency check and
the daemon's events; the watchdog releases it when the daemon stalls. One lock (the
condition's) guards the parts each of those touches: the states
(:mod:`.tensor_state`), the read policy's estimates (:mod:`.read_policy`), the stall
clock (:mod:`.stall`) and the residency lookups (:mod:`.residency_check`). Reports of
reads go out on a thread of their own (:mod:`.reports`).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from spanwarm.client.inline_residency import TensorEnvelopes
from spanwarm.client.own_reads import OwnReads
from spanwarm.client.read_policy import ReadPolicy, plan_rates, read_times
from spanwarm.client.reports import ConsumptionReports, Report
from spanwarm.client.stall import StallClock
from spanwarm.client.tensor_state import Progress, TensorState, TensorStates
from spanwarm.client.wire import span_bytes

__all__ = ["Ticket", "index_read_bytes"]

_PENDING, _READY = TensorState.PENDING, TensorState.READY


class Ticket:
    """Readiness of one request's tensors (checkpoint keys), updated by a background thread."""

    def __init__(self, names: Sequence[str], nbytes: Sequence[int]) -> None:
        self._index = {name: i for i, name in enumerate(names)}
        self._names = list(names)
        self._bytes = list(nbytes)
        self._states = TensorStates(len(names))
        self._cond = threading.Condition()
        self._call: Any = None  # the Warm stream, to cancel
        self.plan: list[dict[str, Any]] = []
        """The node plan for this request's files, once the daemon has accepted it."""
        self.failures: dict[str, str] = {}
        """Tensor -> why the daemon could not warm it."""
        self.finished = threading.Event()
        self._reports = ConsumptionReports(self.finished)
        self._clock = StallClock(time.monotonic())
        self._stalled = False  # released by the watchdog
        self._policy = ReadPolicy(nbytes)
        self._sent: tuple[Any, Any, Any] | None = None  # (file, tensor, bytes) per span
        # Per tensor: whether it was in the page cache when the request went out, and
        # whether the full check has looked at it yet (None until it begins; see
        # residency_check); meanwhile, the loader looks a tensor up itself (_envelopes).
        self._resident: Any = None
        self._known: Any = None
        self._envelopes: TensorEnvelopes | None = None
        self._looked_up: set[int] = set()
        self._own_reads: OwnReads | None = None  # the spans to hint before a cold read

    # -- the loader's side -------------------------------------------------------------

    def wait(self, names: Iterable[str] | None = None, timeout: float | None = None) -> bool:
        """Block until these tensors (all, if None) are warm or released; False on timeout.

        Names the request did not include have nothing to wait for.
        """
        wanted = None if names is None else [self._index[n] for n in names if n in self._index]
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._states.any_pending(wanted):
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

        How long a cold read takes, and when waiting for the daemon is not worth it, is
        :mod:`.read_policy`'s: until the daemon has learned the device, ranks wait as
        :meth:`wait` does; on fast local storage ranks never queue behind the daemon; on
        a slow mount, where the daemon's many reads in flight beat one stream, they wait.
        A tensor resident when the request went out is read at once. Before ``"read"``
        for a tensor that is not warm, the kernel is asked to start reading exactly its
        bytes (:mod:`.own_reads`): the loader's faults then wait for those pages instead
        of reading whole read-ahead windows around them.
        """
        i = self._index.get(name)
        if i is None:
            return "ready"
        if self.finished.is_set():  # every state is final: no lock, nothing to wait for
            return "read" if self._read_at_once(self._states[i], i) else "ready"
        outcome = self._wait_for_read(i, timeout)
        own_reads = self._own_reads  # once: the request may end (and drop it) meanwhile
        if outcome == "read" and self._policy.told(i) and own_reads is not None:
            # Outside the lock: a busy device can hold the hint up, and the stream thread
            # must go on marking tensors ready meanwhile. (hint() raises nothing.)
            cold = own_reads.hint(i)
            if cold is not None:
                with self._cond:
                    self._policy.hinted(i, cold)
        return outcome

    def _wait_for_read(self, i: int, timeout: float | None) -> str:
        start = time.monotonic()
        limit = math.inf if timeout is None else start + timeout
        waited = False  # a bounded wait began: how it ends counts (ReadPolicy.daemon_behind)
        while True:
            with self._cond:
                state = self._states[i]
                if self._read_at_once(state, i):
                    return "read"
                envelopes = self._envelopes
                if (
                    state is _PENDING
                    and envelopes is not None
                    and not self._known[i]
                    and i not in self._looked_up
                ):
                    self._looked_up.add(i)  # once; then as the full check finds it
                else:
                    envelopes = None
                    if state is not _PENDING:
                        if waited and state is _READY:
                            self._policy.warm_in_time()
                        return "ready"
                    now = time.monotonic()
                    step = self._policy.step(i, began=start, limit=limit, waited=waited, now=now)
                    if step.outcome != "wait":
                        return step.outcome
                    waited = step.bounded
                    self._cond.wait(None if step.until == math.inf else step.until - now)
            if envelopes is not None and envelopes.cached(i, lambda: self._cached(i)):
                return "read"  # its file's turn in the full check has not come yet

    def _read_at_once(self, state: TensorState, i: int) -> bool:
        """Tensor ``i`` is read now, not waited for: it was in the page cache when the
        request went out (and not warmed since), or so little was cold that it was never
        asked for."""
        resident = self._resident
        return state is TensorState.OWN or (
            state is not _READY and resident is not None and bool(resident[i])
        )

    def took(self, name: str, seconds: float) -> None:
        """How long the loader took to read ``name`` here after :meth:`wait_for_read` told
        it to read a tensor that was not warm. Once a few MiB of such reads are known, each
        wait is bounded by this rank's own rate as well (:meth:`ReadPolicy.took`). Only
        the tensor's share not in the page cache as the read began counts as read
        (:meth:`OwnReads.hint`)."""
        i = self._index.get(name)
        if i is None or not self._policy.told(i):
            return  # as below, without the lock: a resident load calls this per tensor
        with self._cond:
            self._policy.took(i, seconds)

    def ready(self, name: str) -> bool:
        """True when ``name`` is warm, was resident when the request went out (read it
        now; a few pages of it may be missing, see :mod:`.residency_check`), was reported
        read (:meth:`consumed`) before it was warm, was released, was left to this rank to
        read (``progress.own``), or is not part of the request."""
        i = self._index.get(name)
        return i is None or self._states[i] is not _PENDING

    @property
    def progress(self) -> Progress:
        with self._cond:
            return self._states.progress(self._bytes)

    def consumed(self, names: Iterable[str]) -> None:
        """Tell the daemon these tensors have been read: under a memory budget, warming
        moves on to the next ones, and one read before it was warm is no longer waited for
        (it counts in ``progress.read``) nor warmed for this request, unless tensors not
        yet read share its cells. Returns at once: reports go out in batches
        (:mod:`.reports`)."""
        if self.finished.is_set():
            return  # as below, without the lock: a resident load calls this per tensor
        with self._cond:
            if self.finished.is_set():
                return  # the stream is over, or never began: no request to tell
            states = self._states
            groups = [
                i
                for i in (self._index.get(n) for n in names)
                if i is not None and states[i].asked_for
            ]
            read_first = [i for i in groups if states[i] is _PENDING]
            self._reports.add(groups)
        if read_first:  # outside the lock: marking the last pending one closes descriptors
            self._mark(read_first, TensorState.READ_FIRST, progress=False)

    def cancel(self) -> None:
        """Withdraw the request: the daemon drops warming only it needed. Reads reported
        and not yet sent go first (and are waited for, briefly): ended, the request could
        not take them, and ``--evict-after-read`` would keep what they read."""
        self._reports.flush(wait=True)
        if self._call is not None:
            self._call.cancel()
        self._release()

    # -- the residency check's side ----------------------------------------------------

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
            self._policy.missing(known, missing)
            self._known[known] = True
            if resident.size:
                self._resident[resident] = True
                # In the same step (the condition's lock is re-entrant): no reader sees a
                # tensor resident but still pending.
                self._mark(resident.tolist(), TensorState.RESIDENT)

    def _resident_throughout(self) -> None:
        """Every tensor was found in the page cache before the request went out: each is
        read at once, none asked for (what the full check and a release leave, without
        the check)."""
        with self._cond:
            names = len(self._names)
            self._resident = np.ones(names, dtype=bool)
            self._known = np.ones(names, dtype=bool)
            self._policy.cached(slice(None))
            self._mark(range(names), TensorState.RESIDENT)
        self._release()

    def _cached(self, i: int) -> None:
        """Tensor ``i`` was found wholly in the page cache on the loader's thread."""
        with self._cond:
            if self._states[i] is _PENDING and self._resident is not None:
                self._resident[i] = True
                self._policy.cached(i)
                self._mark([i], TensorState.RESIDENT)

    # -- the ticket's thread's side ----------------------------------------------------

    def _granted(self, rate: float) -> None:
        """The grant's rate of one stream on the slowest mount (0: not known)."""
        with self._cond:
            self._policy.granted_rate = rate

    def _keep_back(self, groups: Any) -> bool:
        """Whether this rank reads ``groups`` (all a request would ask for) itself, not
        worth asking for (:meth:`ReadPolicy.keeps_back`): then they are ``OWN``."""
        with self._cond:
            if not self._policy.keeps_back(groups):
                return False
            self._mark(groups.tolist(), TensorState.OWN, progress=False)
        return True

    def _sending(self, request: Any) -> None:
        """``request`` (a WarmRequest) goes out as it is: waits are bounded from now on,
        at the grant's rate (the slowest mount's), not only once the plan comes."""
        index_read_bytes(self, request)
        with self._cond:
            rate = self._policy.granted_rate
        self._set_read_times(np.full(len(request.files), rate), last=False)

    def _learn_read_times(self, files: list[Any], sent: list[str]) -> None:
        """From the plan's files: per tensor, how long one stream of cold reads would take
        for its bytes on their devices (see :func:`read_times`)."""
        rates = plan_rates([(f.path, f.stream_bytes_per_s) for f in files], sent)
        self._set_read_times(rates, last=True)

    def _set_read_times(self, rate: Any, *, last: bool) -> None:
        """Read times from ``rate`` (bytes/s per file as sent; 0: unknown). The grant gives
        a first figure (the slowest mount's), the plan the last one, per file."""
        sent = self._sent
        if sent is None:
            return
        if last:
            self._sent = None  # a million spans' columns are not kept for the load
        with self._cond:  # only the cold part of a partly resident tensor is read
            cold = self._policy.cold_share()
        seconds = read_times(rate, *sent, cold, len(self._names))
        with self._cond:
            self._policy.read_yourself_s = seconds
            self._cond.notify_all()  # waiters re-read their limit

    def _attach(self, request_id: int, report: Report) -> None:
        """The daemon named the request: reports of reads go out from now on."""
        self._reports.attach(request_id, report)

    def _progressed(self) -> None:
        with self._cond:
            self._clock.progressed(time.monotonic())

    def _heartbeat(self, bytes_done: int) -> None:
        with self._cond:
            self._clock.heartbeat(bytes_done, time.monotonic())

    def _stalled_for(self) -> float:
        """Seconds since the last progress while tensors are pending (0 when none are)."""
        with self._cond:
            return self._clock.stalled_for(time.monotonic()) if self._states.pending else 0.0

    def _still_pending(self) -> int:
        with self._cond:
            return self._states.pending

    def _mark(
        self, groups: Iterable[int], state: TensorState, reason: str = "", *, progress: bool = True
    ) -> None:
        """Move pending groups to ``state``; ``progress``: the daemon's (the watchdog's
        measure), not the rank's own reads."""
        with self._cond:
            now = time.monotonic()
            if progress:
                self._clock.progressed(now)
            moved = self._states.settle(groups, state)
            if reason:
                for i in moved:
                    self.failures[self._names[i]] = reason
            if state == _READY:
                self._policy.warmed(moved, now)
            self._cond.notify_all()
            own_reads = None
            if not self._states.pending:  # nothing left to read cold: no more hints
                own_reads, self._own_reads = self._own_reads, None
        if own_reads is not None:
            own_reads.close()

    def _keep_own_reads(self, own_reads: OwnReads | None) -> None:
        """Hint this request's cold reads from now on (not once nothing is pending)."""
        with self._cond:
            if self._states.pending and not self.finished.is_set():
                self._own_reads, own_reads = own_reads, None
        if own_reads is not None:
            own_reads.close()

    def _release_stalled(self) -> int:
        """The watchdog gave up on the daemon: cancel the stream, release what is pending."""
        self._stalled = True
        if self._call is not None:
            self._call.cancel()
        return self._release()

    def _release(self) -> int:
        """Everything still pending is released to be read cold; returns how many."""
        with self._cond:
            released = self._states.release()
            self._cond.notify_all()
            own_reads, self._own_reads = self._own_reads, None
            self.finished.set()  # under the lock: _own_reads is set only before it
        self._reports.end()  # the reporting thread, if any, ends
        if own_reads is not None:
            own_reads.close()
        return released

    # -- the read policy's figures, read and set under the ticket's lock ---------------

    @property
    def _read_yourself_s(self) -> Any:
        return self._policy.read_yourself_s

    @_read_yourself_s.setter
    def _read_yourself_s(self, seconds: Any) -> None:
        with self._cond:
            self._policy.read_yourself_s = seconds
            self._cond.notify_all()

    @property
    def _waits(self) -> Any:
        return self._policy.waits


def index_read_bytes(ticket: Ticket, request: Any) -> None:
    """Give ``ticket`` the spans of ``request`` (a WarmRequest) as sent: what its read
    times are computed from (``Ticket._set_read_times``)."""
    ticket._sent = span_bytes(request)
