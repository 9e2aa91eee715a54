"""spanwarm for SGLang: every rank warms exactly what its weight loaders copy.

Switched on with ``SPANWARM_SGLANG=1`` in the server's environment (see docs/vllm.md,
"SGLang"). SGLang calls :func:`register` in every process it starts, its schedulers (one
per rank) included, through the ``sglang.srt.plugins`` entry point; without the switch it
imports and registers nothing.
"""

from __future__ import annotations

import logging
import os

__all__ = ["SWITCH", "enabled", "register"]

SWITCH = "SPANWARM_SGLANG"


def enabled() -> bool:
    return os.environ.get(SWITCH, "").strip().lower() not in ("", "0", "false", "no", "off")


def register() -> None:
    """SGLang's plugin entry point: hook the default loader where ``SPANWARM_SGLANG`` is on."""
    if not enabled():
        return
    try:
        from spanwarm.integrations.sglang.plugin import install

        install()
    except Exception as exc:  # an SGLang we do not know: load without spanwarm
        logging.getLogger("sglang.spanwarm").warning(
            "spanwarm: not hooked into SGLang (%s); loads run without prefetch", exc
        )
