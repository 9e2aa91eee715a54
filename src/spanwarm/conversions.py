"""Weight conversions, under their public name (``key_map`` and ``conversions`` of
``spanwarm.client.rank_spans``): the model lives in :mod:`spanwarm.checkpoint.conversions`."""

from spanwarm.checkpoint.conversions import (
    Chunk,
    Concat,
    Conversion,
    Converted,
    Op,
    OtherOp,
    Stack,
    natural_key,
    read_runs,
)

__all__ = [
    "Chunk",
    "Concat",
    "Conversion",
    "Converted",
    "Op",
    "OtherOp",
    "Stack",
    "natural_key",
    "read_runs",
]
