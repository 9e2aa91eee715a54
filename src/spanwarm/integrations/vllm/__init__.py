"""spanwarm for vLLM: every worker warms exactly what its weight loaders copy.

Switched on with ``SPANWARM_VLLM=1`` in the server's environment (see docs/vllm.md).
vLLM calls :func:`register` in every process, through the ``vllm.general_plugins`` entry
point; without the switch it imports and installs nothing.
"""

from __future__ import annotations

import logging
import os

__all__ = ["SWITCH", "enabled", "register"]

SWITCH = "SPANWARM_VLLM"


def enabled() -> bool:
    return os.environ.get(SWITCH, "").strip().lower() not in ("", "0", "false", "no", "off")


def register() -> None:
    """vLLM's plugin entry point: hook the default loader where ``SPANWARM_VLLM`` is on."""
    if not enabled():
        return
    try:
        from spanwarm.integrations.vllm.plugin import install

        install()
    except Exception as exc:  # a vLLM we do not know: load without spanwarm
        logging.getLogger("vllm.spanwarm").warning(
            "spanwarm: not hooked into vLLM (%s); loads run without prefetch", exc
        )
