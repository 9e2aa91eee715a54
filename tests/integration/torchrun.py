"""Run a worker as 4 gloo CPU ranks under torchrun, against a real daemon."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.daemon_harness import running_daemon

__all__ = ["RANKS", "rank_env", "run_ranks"]

RANKS = 4
REPO = Path(__file__).parents[2]


def rank_env() -> dict[str, str]:
    """The environment of a rank process: workers import ``tests.*`` (the repository
    root is on their path), and a rank that dies shows its threads' Python stacks."""
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": str(REPO),
        "PYTHONFAULTHANDLER": "1",
    }


def run_ranks(worker: Path, *args: str) -> None:
    """``worker ARGS... SOCKET`` on every rank, a fresh daemon's socket last; fails the
    test with the ranks' stderr if any rank fails. Workers import ``tests.*``: the
    repository root is on their path."""
    env = rank_env()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    with running_daemon() as daemon:
        run = subprocess.run(
            [*torchrun, "--nproc_per_node", str(RANKS), str(worker), *args, daemon.socket],
            env=env,
            timeout=600,
            capture_output=True,
            text=True,
            cwd=REPO,
        )
    assert run.returncode == 0, run.stderr[-6000:]
