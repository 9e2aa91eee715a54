"""``PrefetchReader``: a DCP ``StorageReader`` that warms exactly what the reader it wraps reads.

``dcp.load`` calls a storage reader in this order: ``read_metadata``,
``set_up_storage_reader``, ``prepare_local_plan``, ``prepare_global_plan`` (on the
coordinator), then ``read_data(final_local_plan, planner)``. The final plan is first
known there, before any data byte is read: :meth:`PrefetchReader.read_data` computes what
the wrapped reader will read for it (:mod:`.reads`), requests those spans from the node's
daemon in read order, and then lets the wrapped reader read, waiting just before each
item and reporting it consumed just after:

- the HF readers read item by item in ``_process_read_request``; that call is gated;
- ``FileSystemReader`` opens each stored chunk with ``_slice_file`` (gated: the wait) and
  hands the result to ``planner.commit_tensor`` or ``planner.load_bytes`` (the report).

Everything else is delegated unchanged, and without a daemon (or for a reader whose reads
are not known) the load is exactly the wrapped reader's, after at most one warning.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from spanwarm.checkpoint.tensor_layout import TensorSpans
from spanwarm.client.client import Client
from spanwarm.integrations.dcp.reads import PlanReads, chunk_name, item_name, plan_reads
from spanwarm.integrations.gate import GatedReads

__all__ = ["DcpLoad", "PrefetchReader"]

logger = logging.getLogger("spanwarm.dcp")

KEEP = 16
"""Records kept per reader and per session: enough to inspect recent loads, bounded for a
process that loads for days."""


@dataclass
class DcpLoad(GatedReads):
    """One ``read_data`` that spanwarm prefetched for (``kind``: how that reader reads)."""

    kind: str = field(default="", kw_only=True)


class PrefetchReader(StorageReader):
    """Wraps ``reader`` (``FileSystemReader``, ``HuggingFaceStorageReader`` or
    ``QuantizedHuggingFaceStorageReader``) and prefetches exactly what it reads.

    ``client`` is the node's daemon (the default socket otherwise), ``job`` the job id
    (``SPANWARM_JOB``, then ``TORCHELASTIC_RUN_ID``, then ``"default"``), and a read whose
    bytes are not warm after ``wait_timeout`` seconds stops the waiting for the rest of
    that load. Attributes this class does not define are the wrapped reader's.
    """

    def __init__(
        self,
        reader: StorageReader,
        *,
        client: Client | None = None,
        job: str | None = None,
        wait_timeout: float | None = 300.0,
    ) -> None:
        if isinstance(reader, PrefetchReader):
            reader = reader.reader
        self.reader: StorageReader = reader
        self.client = client or Client()
        self.job = job
        self.wait_timeout = wait_timeout
        self.loads: list[DcpLoad] = []
        """The last ``KEEP`` prefetched ``read_data``: their spans, tickets and waits."""
        # dcp.load probes these two signatures for ``**kwargs`` (rank-local metadata,
        # collectives off): they must be the wrapped reader's own.
        self.read_metadata = reader.read_metadata  # type: ignore[method-assign]
        self.set_up_storage_reader = reader.set_up_storage_reader  # type: ignore[method-assign]

    @property
    def spans(self) -> list[TensorSpans]:
        """What the last prefetched load requested, in read order (empty before one)."""
        return self.loads[-1].spans if self.loads else []

    def __getattr__(self, name: str) -> Any:
        if name == "reader":  # not set yet: __init__ failed or unpickling
            raise AttributeError(name)
        return getattr(self.reader, name)

    # -- StorageReader, delegated ------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.reader.reset(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        return self.reader.read_metadata(*args, **kwargs)

    def set_up_storage_reader(
        self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self.reader.set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)

    def prepare_local_plan(self, plan: Any) -> Any:
        return self.reader.prepare_local_plan(plan)

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        return self.reader.prepare_global_plan(plans)

    @property
    def checkpoint_id(self) -> Any:
        return self.reader.checkpoint_id  # type: ignore[attr-defined]

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False  # never chosen by dcp's inference: it wraps the reader that is

    # -- the reads ---------------------------------------------------------------------

    def read_data(self, plan: Any, planner: Any) -> Future[None]:
        load = self._request(plan)
        if load is None:
            return self.reader.read_data(plan, planner)
        try:
            with contextlib.ExitStack() as gate:
                try:
                    gated_planner = gate.enter_context(_gated(self.reader, load, plan, planner))
                except Exception as exc:  # a reader of another shape: read it unwaited
                    logger.warning("spanwarm: cannot gate this load's reads (%s)", exc)
                    gated_planner = planner
                return self.reader.read_data(plan, gated_planner)
        finally:
            try:
                load.ticket.cancel()  # the load is over: release whatever it still holds
            except Exception as exc:  # the load's own outcome stands
                logger.warning("spanwarm: ending the request: %s", exc)

    def _request(self, plan: Any) -> DcpLoad | None:
        """Request this plan's bytes; None when the load goes on without prefetch. Any
        error in here (a client object of another shape included) is one warning."""
        try:
            if self.client.disabled or not plan.items:
                return None
            reads: PlanReads | None = plan_reads(self.reader, plan)
            if reads is None:
                logger.warning(
                    "spanwarm: %s reads in a way spanwarm does not know; loading without prefetch",
                    type(self.reader).__name__,
                )
                return None
            ticket = self.client.request(reads.spans, job=self.job)
        except Exception as exc:  # never fail a load over a prefetch
            logger.warning("spanwarm: cannot plan this load (%s); loading without prefetch", exc)
            return None
        load = DcpLoad(reads.spans, ticket, self.wait_timeout, kind=reads.kind)
        self.loads = [*self.loads[-(KEEP - 1) :], load]
        return load


class _CommitReports:
    """A load planner whose commits report the item's chunk consumed (native format)."""

    def __init__(self, planner: Any, report: Callable[[Any], None]) -> None:
        self._planner = planner
        self._report = report

    def commit_tensor(self, read_item: Any, tensor: Any) -> None:
        try:
            self._planner.commit_tensor(read_item, tensor)
        finally:
            self._report(read_item)

    def load_bytes(self, read_item: Any, value: Any) -> None:
        try:
            self._planner.load_bytes(read_item, value)
        finally:
            self._report(read_item)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)


@contextlib.contextmanager
def _gated(reader: Any, load: DcpLoad, plan: Any, planner: Any) -> Iterator[Any]:
    """Gate ``reader``'s per-item reads on readiness while the block runs (instance
    attributes, removed after); yields the planner to hand to its ``read_data``. A load
    of the same reader started meanwhile (another thread, a nested load) sees the gate and
    is not prefetched (:func:`.reads.reader_kind`); its reads pass the gate unwaited,
    since they name no item of this request."""
    cls = type(reader)
    if load.kind == "native":
        # _slice_file gets the chunk's _StorageInfo; every item of a chunk shares it.
        names = {
            id(reader.storage_data[i.storage_index]): chunk_name(i.storage_index)
            for i in plan.items
        }

        def slice_file(file: Any, info: Any) -> Any:
            name = names.get(id(info))
            if name is not None:
                load.before_read(name)
            return cls._slice_file(reader, file, info)

        reader._slice_file = slice_file
        try:
            yield _CommitReports(planner, lambda i: load.after_read(chunk_name(i.storage_index)))
        finally:
            vars(reader).pop("_slice_file", None)
        return

    def process(file: Any, item: Any, planner: Any) -> None:
        name = item_name(item)
        load.before_read(name)
        try:
            cls._process_read_request(reader, file, item, planner)
        finally:
            load.after_read(name)

    reader._process_read_request = process
    try:
        yield planner
    finally:
        vars(reader).pop("_process_read_request", None)
