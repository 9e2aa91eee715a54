"""What the rank's environment says about its requests: whether to make any, and whose.

``SPANWARM_DISABLE`` turns every request into a no-op (integrations check it before they
do any work of their own). A request names its job (``SPANWARM_JOB``, else torchrun's
``TORCHELASTIC_RUN_ID``) and the rank (torch.distributed's, else ``RANK``): the daemon
shares work across jobs and ranks, and shows them in ``spanwarm status``.
"""

from __future__ import annotations

import os

__all__ = ["disabled_by_environment", "job_id", "this_rank"]


def disabled_by_environment() -> bool:
    """``SPANWARM_DISABLE`` set (and not 0): every request is a no-op."""
    return os.environ.get("SPANWARM_DISABLE", "") not in ("", "0")


def job_id(job: str | None = None) -> str:
    """``job``, else the environment's job, else ``"default"``."""
    return (
        job or os.environ.get("SPANWARM_JOB") or os.environ.get("TORCHELASTIC_RUN_ID") or "default"
    )


def this_rank() -> int:
    """This process's global rank: torch.distributed's once it is initialised, else
    ``RANK``, else 0."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    except ImportError:
        pass
    return int(os.environ.get("RANK", "0"))
