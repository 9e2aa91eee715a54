"""spanwarm for vLLM: every worker warms exactly what its weight loaders copy.

Switched on with ``SPANWARM_VLLM=1`` in the server's environment (see docs/vllm.md).
vLLM calls :func:`register` in every process, through the ``vllm.general_plugins`` entry
point; without the switch it imports and installs nothing.
"""

from __future__ import annotations

from spanwarm.integrations import server_plugin

__all__ = ["SWITCH", "enabled", "register"]

SWITCH = "SPANWARM_VLLM"


def enabled() -> bool:
    return server_plugin.flag(SWITCH, default=False)


def register() -> None:
    """vLLM's plugin entry point: hook the default loader where ``SPANWARM_VLLM`` is on."""
    server_plugin.register(SWITCH, f"{__name__}.plugin", "vllm.spanwarm", "vLLM")
