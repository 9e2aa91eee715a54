"""The touch recorder of every integration's dry run (:mod:`spanwarm.integrations.touches`)."""

from __future__ import annotations

from spanwarm.integrations.touches import Region, TouchRecorder, region_spans, spans_of

__all__ = ["Region", "TouchRecorder", "region_spans", "spans_of"]
