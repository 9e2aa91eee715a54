"""An inference server's plugin entry point, as every server integration has it
(:mod:`spanwarm.integrations.vllm`, :mod:`spanwarm.integrations.sglang`): the switches
the environment sets, and an install that only the main switch lets happen.

This module imports nothing heavy: the server runs the entry point in every process it
starts, and with the switch off, spanwarm must cost it nothing.
"""

from __future__ import annotations

import importlib
import logging
import os

__all__ = ["flag", "register"]

_OFF = ("0", "false", "no", "off")


def flag(variable: str, default: bool) -> bool:
    """A switch in the environment: unset or empty, ``default``; ``0``, ``false``, ``no``
    or ``off`` (any case), off; anything else (``1``, ``true``, ``yes``, ``on``), on."""
    value = os.environ.get(variable, "").strip().lower()
    if not value:
        return default
    return value not in _OFF


def register(switch: str, plugin: str, logger: str, server: str) -> None:
    """A plugin entry point: where ``switch`` is on, ``install()`` of the module ``plugin``;
    where that fails (a ``server`` we do not know), one warning on ``logger``, and the
    loads run without spanwarm."""
    if not flag(switch, default=False):
        return
    try:
        importlib.import_module(plugin).install()
    except Exception as exc:
        logging.getLogger(logger).warning(
            "spanwarm: not hooked into %s (%s); loads run without prefetch", server, exc
        )
