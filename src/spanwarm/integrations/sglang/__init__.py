"""spanwarm for SGLang: every rank warms exactly what its weight loaders copy.

Switched on with ``SPANWARM_SGLANG=1`` in the server's environment (see docs/vllm.md,
"SGLang"). SGLang calls :func:`register` in every process it starts, its schedulers (one
per rank) included, through the ``sglang.srt.plugins`` entry point; without the switch it
imports and registers nothing.
"""

from __future__ import annotations

from spanwarm.integrations import server_plugin

__all__ = ["SWITCH", "enabled", "register"]

SWITCH = "SPANWARM_SGLANG"


def enabled() -> bool:
    return server_plugin.flag(SWITCH, default=False)


def register() -> None:
    """SGLang's plugin entry point: hook the default loader where ``SPANWARM_SGLANG`` is on."""
    server_plugin.register(SWITCH, f"{__name__}.plugin", "sglang.spanwarm", "SGLang")
