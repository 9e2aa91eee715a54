"""One rank's load of an inference server's weights and its request to the node's daemon,
as every server integration makes it (:mod:`spanwarm.integrations.vllm`,
:mod:`spanwarm.integrations.sglang`).

The integration's hooks find the rank's reads with the dry run
(:mod:`spanwarm.integrations.meta_dry_run`) and hand the plan to :meth:`RankLoad.begin`:
it is written where ``<PREFIX>_SPANS_DIR`` asks (``rank-<R>.json``), said in one log
line, and requested as rank :func:`global_rank` of the server's job; the loader's reads
then go through the request's :class:`~spanwarm.integrations.gate.GatedReads`, and
:meth:`RankLoad.end` ends the request with the load. What tells one server from another
(its variables' prefix, its logger, its job's name) is a :class:`Server`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from spanwarm.client.environment import disabled_by_environment
from spanwarm.integrations.gate import GatedReads
from spanwarm.integrations.server_plugin import flag

if TYPE_CHECKING:
    from spanwarm.integrations.meta_dry_run import DryRun

__all__ = ["RankLoad", "Server", "global_rank"]

WAIT_TIMEOUT_S = 300.0
"""The longest a read waits for its tensor before the load goes on cold."""


@dataclass(eq=False)
class Server:
    """One inference server's integration: its settings ``<prefix>_SPANS_DIR`` (each rank's
    request, as JSON: ``rank-<R>.json``) and ``<prefix>_READ_YOURSELF`` (0: always wait for
    the daemon), the logger its lines go to, the name of the job its ranks' requests
    belong to (``job()``, asked as each request goes out), and what it does once per
    process (its install, the lines it says once)."""

    prefix: str
    logger: logging.Logger
    job: Callable[[], str]
    _said: set[str] = field(default_factory=set, init=False, repr=False)
    _installed: bool = field(default=False, init=False, repr=False)
    _install_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    @property
    def spans_dir(self) -> str:
        return f"{self.prefix}_SPANS_DIR"

    @property
    def read_yourself(self) -> str:
        return f"{self.prefix}_READ_YOURSELF"

    def install(self, hooks: Callable[[], None]) -> None:
        """``hooks()`` (what hooks the server's loader) once per process: until a call
        returns, each call makes it; then one log line."""
        with self._install_lock:
            if self._installed:
                return
            hooks()
            self._installed = True
        self.logger.info("spanwarm: warming each rank's exact reads of safetensors checkpoints")

    def nothing_to_ask(self) -> bool:
        """SPANWARM_DISABLE, and no record of the request to write: no dry run is needed."""
        return disabled_by_environment() and not os.environ.get(self.spans_dir)

    def say_once(self, line: str) -> None:
        if line not in self._said:
            self._said.add(line)
            self.logger.info("spanwarm: %s", line)

    def loading_cold(self, exc: BaseException) -> None:
        self.logger.warning("spanwarm: no prefetch for this load (%s); loading cold", exc)

    def write_spans(self, plan: DryRun) -> None:
        """Where ``<prefix>_SPANS_DIR`` names a directory, this rank's request goes to
        ``rank-<R>.json`` there: what it reads, as the dry run found it."""
        directory = os.environ.get(self.spans_dir)
        if not directory:
            return
        rank = global_rank()
        record = {
            "rank": rank,
            "exact": plan.exact,
            "reason": plan.reason,
            "dry_run_s": plan.seconds,
            "handed_out": [item.name for item in plan.handed_out],
            "spans": [
                [s.tensor, s.path, s.offset, s.length, s.stride, s.count] for s in plan.spans
            ],
        }
        path = os.path.join(directory, f"rank-{rank}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(record, f)
        os.replace(path + ".tmp", path)


class RankLoad:
    """One load of a rank's weights and its request: :meth:`begin` with the dry run's
    plan, :meth:`end` when the load is over."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.gate: GatedReads | None = None
        self.plan: DryRun | None = None
        self.loading = False  # the integration's load of the weights is running
        self._ended = False
        self._client: Any = None

    def daemon_present(self) -> bool:
        """Whether the daemon's socket is there at all (a request to none is released)."""
        return self._client is not None and os.path.exists(self._client.socket)

    def begin(self, plan: DryRun) -> None:
        """Request what ``plan`` names (the load goes on cold where that fails)."""
        self.plan = plan
        if not plan.exact:
            self.server.logger.warning(
                "spanwarm: the dry run cannot tell this rank's reads (%s); warming the "
                "tensors it is handed, whole",
                plan.reason,
            )
        try:
            self.gate = self._request(plan)
        except Exception as exc:
            self.server.loading_cold(exc)
            self.gate = None

    def _request(self, plan: DryRun) -> GatedReads | None:
        from spanwarm.client import Client

        server = self.server
        try:
            server.write_spans(plan)
        except OSError as exc:  # a record of the request, not the request
            server.logger.warning(
                "spanwarm: cannot write this rank's request to %s: %s", server.spans_dir, exc
            )
        server.logger.info(
            "spanwarm: rank %d reads %d tensors, %.1f MiB in %d spans (%s, %.2f s)",
            global_rank(),
            len({s.tensor for s in plan.spans}),
            sum(s.length * s.count for s in plan.spans) / 2**20,
            len(plan.spans),
            "dry run" if plan.exact else "whole tensors",
            plan.seconds,
        )
        if not plan.spans or disabled_by_environment():
            return None
        self._client = Client(read_yourself=flag(server.read_yourself, default=True))
        ticket = self._client.request(plan.spans, job=server.job(), rank=global_rank())
        return GatedReads(plan.spans, ticket, WAIT_TIMEOUT_S)

    def end(self) -> None:
        """The load is over: the request ends (the daemon drops warming only it needed)."""
        if self._ended:
            return
        self._ended = True
        gate = self.gate
        try:
            if gate is not None:
                gate.ticket.cancel()
                if gate.waited_s or gate.read_yourself:
                    self.server.logger.info(
                        "spanwarm: waited %.2f s for warm tensors; read %d tensors itself",
                        gate.waited_s,
                        gate.read_yourself,
                    )
        except Exception as exc:
            self.server.logger.warning("spanwarm: ending the request: %s", exc)
        finally:
            if self._client is not None:
                with contextlib.suppress(Exception):  # the load's own outcome stands
                    self._client.close()


def global_rank() -> int:
    """The rank's place in its torch world (vLLM offsets it by the data-parallel rank
    already, where replicas share one world); 0 where there is none."""
    import torch.distributed as dist

    return int(dist.get_rank()) if dist.is_available() and dist.is_initialized() else 0
