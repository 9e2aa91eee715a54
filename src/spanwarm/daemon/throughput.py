"""What one stream of reads gets from each device, learned from the daemon's own reads.

Every piece the daemon reads cold (nothing of it resident before) is a sample: its bytes
and the seconds the storage took (the warm engine's I/O time, without any throttle). Per
``st_dev``, the samples' bytes over their seconds, weighted toward recent ones
(exponential decay by bytes, half-life ``HALF_LIFE_BYTES``), is the throughput of one
stream of the daemon's piece size there: latency included, which is what a rank's own
read of a tensor would also pay.

A rank uses it to decide whether waiting is worth it (:meth:`Ticket.wait_for_read`): a
tensor that is not warm after as long as the rank would take to read it cold itself is
read by the rank. On fast local storage that means ranks never queue behind the daemon;
on a slow mount, where one stream is what the daemon's many in flight beat, they wait.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

__all__ = ["HALF_LIFE_BYTES", "MIN_SAMPLE_BYTES", "StreamThroughput"]

HALF_LIFE_BYTES = 1 << 30  # samples older by a GiB of reads count half
MIN_SAMPLE_BYTES = 64 << 10  # smaller reads are all latency: they would say little
_MIN_BYTES = 8 << 20  # not known until this much has been read cold on the device


@dataclass
class _Device:
    weighted_bytes: float = 0.0
    weighted_seconds: float = 0.0
    total_bytes: int = 0


class StreamThroughput:
    """Per device: bytes per second of one stream of cold reads (thread-safe)."""

    def __init__(self) -> None:
        self._devices: dict[int, _Device] = {}
        self._lock = threading.Lock()

    def record(self, device: int, nbytes: int, seconds: float) -> None:
        """One cold read of ``nbytes`` that took ``seconds`` on ``device``."""
        if nbytes < MIN_SAMPLE_BYTES or not seconds > 0:
            return
        with self._lock:
            d = self._devices.setdefault(device, _Device())
            keep = 0.5 ** (nbytes / HALF_LIFE_BYTES)
            d.weighted_bytes = d.weighted_bytes * keep + nbytes
            d.weighted_seconds = d.weighted_seconds * keep + seconds
            d.total_bytes += nbytes

    def bytes_per_s(self, device: int) -> float:
        """The learned throughput; 0.0 while too little has been read there to tell."""
        with self._lock:
            d = self._devices.get(device)
            if d is None or d.total_bytes < _MIN_BYTES or d.weighted_seconds <= 0:
                return 0.0
            return d.weighted_bytes / d.weighted_seconds

    def snapshot(self) -> dict[int, tuple[float, int]]:
        """Device -> (bytes per second, or 0.0 while unknown; bytes sampled)."""
        with self._lock:
            devices = list(self._devices)
        return {dev: (self.bytes_per_s(dev), self._devices[dev].total_bytes) for dev in devices}
