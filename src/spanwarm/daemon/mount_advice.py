"""Telling the operator that a job and the daemon see a checkpoint at different paths.

The allowed roots are checked on the kernel's name for each descriptor a caller hands
over, which is the path in the caller's own mount namespace. A daemon in a container
with the checkpoint mounted at another path than in the job pods (or on the host)
therefore refuses every grant there: the rank's log says so, once per load, and
nothing else does. So the first such refusal per mount is logged at WARNING, naming
the path the job used, where the daemon sees the same file (looked up under its
allowed roots by the name's trailing components), and the mount to change.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

__all__ = ["MountAdvice"]

logger = logging.getLogger("spanwarm.daemon")

_MAX_KEYS = 1024  # mounts (and directories) warned about; past them, the rest is silent
_MAX_DEPTH = 32  # trailing components of a name tried under each root


class MountAdvice:
    """``seen_at(path, st)`` says whether the daemon sees the file ``st`` describes at
    ``path`` (through no symlink); the allowed roots are where it looks."""

    def __init__(
        self, roots: tuple[str, ...], seen_at: Callable[[str, os.stat_result], bool]
    ) -> None:
        self.roots = roots
        self._seen_at = seen_at
        self._keys: set[tuple[object, ...]] = set()
        self._lock = threading.Lock()  # grants are checked in one thread pool per uid

    def _first(self, key: tuple[object, ...]) -> bool:
        with self._lock:
            if key in self._keys or len(self._keys) >= _MAX_KEYS:
                return False
            self._keys.add(key)
            return True

    def outside(self, who: str, name: str, st: os.stat_result) -> None:
        """A descriptor named ``name`` (by its opener's view) was refused as outside the
        allowed roots."""
        directory = os.path.dirname(name)
        if not self._first(("dir", st.st_dev, directory)):
            return
        try:
            found = self._find(name, st)
        except OSError:  # out of descriptors: the refusal stands, the advice waits
            found = None
        if found is None:
            logger.warning(
                "refused %s's %s: outside the allowed roots %s, and the daemon sees no "
                "such file under them. If it is a checkpoint to warm, mount it at the same "
                "path in the daemon and the job pods (here %s) and --allow that path.",
                who,
                ascii(name),
                list(self.roots),
                ascii(directory),
            )
            return
        job_mount, daemon_mount = found
        if not self._first(("mount", job_mount, daemon_mount)):
            return
        logger.warning(
            "refused %s's %s: outside the allowed roots %s, yet it is the daemon's %s. "
            "The job has the checkpoint at %s and the daemon at %s: every grant there is "
            "refused until both mount it at the same path (e.g. %s in the daemon and the "
            "job pods, with --allow %s). Logged once per mount.",
            who,
            ascii(name),
            list(self.roots),
            ascii(os.path.join(daemon_mount, os.path.relpath(name, job_mount))),
            ascii(job_mount),
            ascii(daemon_mount),
            ascii(job_mount),
            ascii(job_mount),
        )

    def elsewhere(self, who: str, name: str, st: os.stat_result) -> None:
        """A descriptor named ``name``, inside an allowed root, was refused: the daemon has
        another file (or none) there."""
        root = next(
            (r for r in self.roots if name == r or name.startswith(r.rstrip("/") + "/")), name
        )
        if not self._first(("elsewhere", root, st.st_dev)):
            return
        logger.warning(
            "refused %s's %s: the daemon has another file, or none, at that path: the "
            "job and the daemon mount different things at %s. Mount the same checkpoint at "
            "the same path in the daemon and the job pods. Logged once per mount.",
            who,
            ascii(name),
            ascii(root),
        )

    def _find(self, name: str, st: os.stat_result) -> tuple[str, str] | None:
        """(the job's mount, the daemon's) where the daemon sees this very file under an
        allowed root at the name's last components: the shortest such suffix."""
        parts = [p for p in name.split("/") if p]
        for depth in range(1, min(len(parts), _MAX_DEPTH) + 1):
            tail = "/".join(parts[-depth:])
            for root in self.roots:
                if self._seen_at(os.path.join(root, tail), st):
                    job = "/" + "/".join(parts[:-depth])
                    return job, root
        return None
