"""How a torchrun worker of the tests ends."""

from __future__ import annotations

import os
import sys
import threading
from typing import NoReturn

__all__ = ["exit_rank"]


def exit_rank() -> NoReturn:
    """Exit without the interpreter's teardown, once the worker has written its results.

    A gloo worker thread may still be destroying a finished collective's work when Python
    finalizes; the work holds tensors, their decref needs the GIL, and a thread asking for
    the GIL during finalization is unwound through C++ frames that cannot unwind: SIGABRT,
    "terminate called without an active exception", even after ``destroy_process_group()``
    (the mesh still holds the group). Seen once in 30 runs of the torchtitan worker, with
    the core dump's stack in ``ProcessGroupGloo::runLoop`` -> ``~AsyncBarrierWork``;
    pytorch/pytorch#190489.

    What the teardown would still have caught is checked here: a thread that is not a
    daemon would have kept the process from exiting (a hang), so it fails the rank.
    """
    main = threading.main_thread()
    stuck = [t.name for t in threading.enumerate() if not t.daemon and t is not main]
    if stuck:
        print(f"threads that would keep the rank from exiting: {stuck}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if stuck else 0)
