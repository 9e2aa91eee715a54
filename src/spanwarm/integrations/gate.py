"""What every loader integration does around a read: wait for the bytes, then report them.

A loader hook calls :meth:`GatedReads.before_read` just before it reads one of the
request's tensors and :meth:`GatedReads.after_read` just after. The first wait that times
out (or fails) ends all waiting for that load: one warning, and the rest reads cold, as
without spanwarm. A failing report does the same. Nothing here can fail a read.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from spanwarm.checkpoint.tensor_layout import TensorSpans
from spanwarm.client.ticket import Ticket

__all__ = ["GatedReads"]

logger = logging.getLogger("spanwarm.integrations")


@dataclass
class GatedReads:
    """One load's request (``spans``, answered by ``ticket``) and how its reads went."""

    spans: list[TensorSpans]
    ticket: Ticket
    wait_timeout: float | None
    waited_s: float = field(default=0.0, kw_only=True)
    """Time the loader's reads spent waiting for readiness, summed over its threads."""
    timed_out: bool = field(default=False, kw_only=True)
    read_yourself: int = field(default=0, kw_only=True)
    """Tensors read before they were warm, because reading them here was sooner."""
    _read: set[str] = field(default_factory=set, kw_only=True)
    _reading: dict[str, float] = field(default_factory=dict, kw_only=True)
    _lock: threading.Lock = field(default_factory=threading.Lock, kw_only=True)

    @property
    def requested_bytes(self) -> int:
        return sum(s.length * s.count for s in self.spans)

    def before_read(self, name: str) -> None:
        """Wait until ``name`` is warm, or until reading it here would be sooner
        (:meth:`Ticket.wait_for_read`); the load goes on unwaited after a timeout."""
        if self.timed_out:
            return
        start = time.monotonic()
        try:
            outcome = self.ticket.wait_for_read(name, timeout=self.wait_timeout)
        except Exception as exc:  # never fail a read over a prefetch
            outcome = "failed"
            logger.warning("spanwarm: waiting for %s failed: %s", name, exc)
        with self._lock:
            now = time.monotonic()
            self.waited_s += now - start
            if outcome == "read":
                self.read_yourself += 1
                self._reading[name] = now  # timed until after_read (Ticket.took)
            elif outcome != "ready" and not self.timed_out:
                self.timed_out = True
                logger.warning(
                    "spanwarm: %s not warm after %ss; reading the rest of this load unwaited",
                    name,
                    self.wait_timeout,
                )

    def after_read(self, name: str) -> None:
        """Report ``name`` read once (only the first read of a tensor counts)."""
        with self._lock:
            first = name not in self._read
            self._read.add(name)
            began = self._reading.pop(name, None)
        if began is not None:
            try:
                self.ticket.took(name, time.monotonic() - began)
            except Exception as exc:  # a rate estimate, never worth a failed read
                logger.debug("spanwarm: cannot time %s: %s", name, exc)
        if first and not self.timed_out:
            try:
                self.ticket.consumed([name])
            except Exception as exc:  # e.g. a closed client: stop reporting, keep loading
                self.timed_out = True
                logger.warning("spanwarm: cannot report %s read: %s", name, exc)
