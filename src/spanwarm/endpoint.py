"""Where the node's daemon listens: shared by the daemon and its clients."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["default_socket_path"]


def default_socket_path() -> str:
    """``$SPANWARM_SOCKET``, else /run/spanwarm/spanwarm.sock as root, else a per-user path
    (``$XDG_RUNTIME_DIR/spanwarm.sock``, or a private directory in the temp dir)."""
    if env := os.environ.get("SPANWARM_SOCKET"):
        return env
    if os.geteuid() == 0:
        return "/run/spanwarm/spanwarm.sock"
    if runtime := os.environ.get("XDG_RUNTIME_DIR"):
        return str(Path(runtime) / "spanwarm.sock")
    return str(Path(tempfile.gettempdir()) / f"spanwarm-{os.geteuid()}" / "spanwarm.sock")
