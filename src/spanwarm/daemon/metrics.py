"""Prometheus metrics of the daemon (served with ``--metrics HOST:PORT``).

Counters move where the work happens (on the event loop); gauges are refreshed from
the node's status once a second, so the exporter's thread never reads live state.
"""

from __future__ import annotations

import logging
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

__all__ = ["Metrics"]

logger = logging.getLogger("spanwarm.daemon")


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requested = Counter(
            "spanwarm_requested_bytes", "Bytes named by accepted Warm requests", registry=r
        )
        self.deduped = Counter(
            "spanwarm_deduped_bytes",
            "Requested bytes another live request already had in the node plan",
            registry=r,
        )
        self.warmed = Counter(
            "spanwarm_warmed_bytes",
            "Bytes read into the page cache, by method",
            ["method"],
            registry=r,
        )
        self.resident = Counter(
            "spanwarm_found_resident_bytes",
            "Planned bytes found already resident and not read again",
            registry=r,
        )
        self.evicted = Counter(
            "spanwarm_evicted_bytes",
            "Warmed bytes dropped from the page cache once read (--evict-after-read)",
            registry=r,
        )
        self.errors = Counter(
            "spanwarm_errors",
            "Refused requests and failed groups, by gRPC code",
            ["code"],
            registry=r,
        )
        self.refusals = Counter(
            "spanwarm_refusals",
            "Refused grants and Warm requests, by cause (as spanwarm status counts them)",
            ["cause"],
            registry=r,
        )
        self.latency = Histogram(
            "spanwarm_warm_operation_seconds",
            "Duration of one warm operation (at most one chunk)",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=r,
        )
        self.files = Gauge(
            "spanwarm_files", "Files in the node plan, by decision", ["decision"], registry=r
        )
        self.queue_depth = Gauge("spanwarm_queue_depth", "Cells waiting to be warmed", registry=r)
        self.in_flight = Gauge("spanwarm_in_flight", "Warm operations running", registry=r)
        self.active = Gauge("spanwarm_active_requests", "Live Warm requests", registry=r)
        self.planned = Gauge("spanwarm_planned_bytes", "Bytes the node plan reads", registry=r)
        self.warm = Gauge("spanwarm_warm_bytes", "Bytes of the node plan warmed so far", registry=r)

    def add(self, metric: Any, amount: float = 1.0, *labels: str) -> None:
        """Count ``amount`` on ``metric`` (a Counter or Histogram, with ``labels``). Never
        raises: a metric is never a reason to fail a request."""
        try:
            target = metric.labels(*labels) if labels else metric
            if isinstance(target, Histogram):
                target.observe(amount)
            elif amount > 0:
                target.inc(amount)
        except Exception:
            logger.debug("metric %s: cannot count %r", metric, amount, exc_info=True)

    def refresh(self, status: dict[str, Any]) -> None:
        """Set the gauges from a ``Node.status()`` snapshot."""
        for decision in ("spans", "whole"):
            self.files.labels(decision).set(
                sum(1 for f in status["files"] if f["decision"] == decision)
            )
        self.queue_depth.set(status["queue_depth"])
        self.in_flight.set(status["in_flight"])
        self.active.set(len(status["ranks"]))
        self.planned.set(status["bytes_planned"])
        self.warm.set(status["bytes_warm"])

    def serve(self, address: str) -> None:
        host, port = address.rsplit(":", 1)
        start_http_server(int(port), addr=host.strip("[]"), registry=self.registry)
