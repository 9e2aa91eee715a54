"""PrefetchReader and enable() in one process (``dcp.load`` without a process group).

Real checkpoints written by torch in tmp_path, a real daemon on a private socket. What
the full 4-rank matrix does not reach: readers spanwarm does not know, several reading
threads, a failing read, ``SPANWARM_DISABLE``, and that torch's function comes back.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from safetensors.torch import save_file  # noqa: E402
from torch.distributed.checkpoint import state_dict_loader  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner  # noqa: E402
from torch.distributed.checkpoint.filesystem import FileSystemReader  # noqa: E402
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader  # noqa: E402
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load  # noqa: E402
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save  # noqa: E402

import spanwarm.integrations.dcp as spanwarm_dcp  # noqa: E402
from spanwarm.client import Client  # noqa: E402
from spanwarm.integrations.dcp import PrefetchReader  # noqa: E402
from spanwarm.integrations.dcp.reads import reader_kind  # noqa: E402
from spanwarm.pagecache.residency import evict, file_residency  # noqa: E402
from tests.daemon_harness import running_daemon  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _waiting(socket: str) -> Client:
    """A client whose ranks wait for every item: these tests check what the daemon warmed
    (reading before warm, on fast storage, is test_read_yourself's subject)."""
    return Client(socket, read_yourself=False)


def _originals() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(2)
    return {f"layer{i}.weight": torch.randn(64 + 8 * i, 96, generator=gen) for i in range(6)}


@pytest.fixture(scope="module")
def daemon() -> Iterator[str]:
    with running_daemon() as running:
        yield running.socket


@pytest.fixture
def hf_dir(tmp_path: Path) -> Path:
    """Three safetensors files, two tensors each (HuggingFaceStorageReader reads them all)."""
    full = _originals()
    names = list(full)
    for i in range(3):
        part = {n: full[n] for n in names[2 * i : 2 * i + 2]}
        save_file(part, str(tmp_path / f"model-0000{i + 1}-of-00003.safetensors"))
    for path in tmp_path.glob("*.safetensors"):
        evict(path)
    return tmp_path


@pytest.fixture
def native_dir(tmp_path: Path) -> Path:
    dcp_save(_originals(), checkpoint_id=str(tmp_path / "native"), no_dist=True)
    for path in (tmp_path / "native").iterdir():
        evict(path)
    return tmp_path / "native"


def _zeros() -> dict[str, Any]:
    return {k: torch.zeros_like(v) for k, v in _originals().items()}


def _equal(state: dict[str, Any]) -> bool:
    return all(torch.equal(state[k], v) for k, v in _originals().items())


def test_several_reading_threads_wait_each_for_its_own_item(hf_dir: Path, daemon: str) -> None:
    inner = HuggingFaceStorageReader(str(hf_dir), thread_count=3)
    reader = PrefetchReader(inner, client=_waiting(daemon))
    state = _zeros()
    dcp_load(state, storage_reader=reader, no_dist=True)
    assert _equal(state)
    (load,) = reader.loads
    progress = load.ticket.progress
    assert progress.ready == progress.groups == 6
    assert load.kind == "safetensors"
    # each tensor is read whole here: the spans are the files' data sections
    for path in hf_dir.glob("*.safetensors"):
        spans = [s for s in reader.spans if s.path == str(path)]
        assert sum(s.length * s.count for s in spans) == path.stat().st_size - (
            8 + int.from_bytes(path.read_bytes()[:8], "little")
        )
    # the gate is gone afterwards: the reader is the one torch gave us
    assert "_process_read_request" not in vars(reader.reader)


def test_the_native_format_is_warmed_before_it_is_read(native_dir: Path, daemon: str) -> None:
    reader = PrefetchReader(FileSystemReader(str(native_dir)), client=_waiting(daemon))
    state = _zeros()
    dcp_load(state, storage_reader=reader, no_dist=True)
    assert _equal(state)
    (load,) = reader.loads
    assert load.kind == "native"
    assert load.ticket.progress.ready == load.ticket.progress.groups == 6
    (data,) = native_dir.glob("*.distcp")
    resident, pages = file_residency(data)
    assert resident == pages  # checked right after the load: idle cache is reclaimed
    assert "_slice_file" not in vars(reader.reader)


def test_an_unknown_reader_loads_unchanged_after_one_warning(
    hf_dir: Path, daemon: str, caplog: pytest.LogCaptureFixture
) -> None:
    class OwnReads(HuggingFaceStorageReader):
        def _process_read_request(self, f: Any, req: Any, planner: Any) -> None:
            super()._process_read_request(f, req, planner)

    assert reader_kind(OwnReads(str(hf_dir))) is None
    reader = PrefetchReader(OwnReads(str(hf_dir)), client=_waiting(daemon))
    state = _zeros()
    with caplog.at_level(logging.WARNING, logger="spanwarm"):
        dcp_load(state, storage_reader=reader, no_dist=True)
    assert _equal(state)
    assert reader.loads == []
    assert [r.getMessage() for r in caplog.records] == [
        "spanwarm: OwnReads reads in a way spanwarm does not know; loading without prefetch"
    ]


def test_a_failing_read_fails_the_load_as_without_spanwarm(hf_dir: Path, daemon: str) -> None:
    class FailingCommit(DefaultLoadPlanner):
        def commit_tensor(self, read_item: Any, tensor: Any) -> None:
            raise OSError(5, "Input/output error")

    reader = PrefetchReader(HuggingFaceStorageReader(str(hf_dir)), client=_waiting(daemon))
    with pytest.raises(CheckpointException, match="Input/output error"):
        dcp_load(_zeros(), storage_reader=reader, planner=FailingCommit(), no_dist=True)
    (load,) = reader.loads
    assert load.ticket.finished.wait(10)  # cancelled: nothing is left held for it
    assert "_process_read_request" not in vars(reader.reader)


def test_any_error_in_spanwarm_leaves_the_load_going_cold(
    hf_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A client of another shape (no ``disabled``, a ``request`` that raises): every
    ``dcp.load`` still loads, with one warning, and nothing is requested."""

    class Broken:
        def request(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("the client broke")

    reader = PrefetchReader(HuggingFaceStorageReader(str(hf_dir)), client=Broken())  # type: ignore[arg-type]
    state = _zeros()
    with caplog.at_level(logging.WARNING, logger="spanwarm"):
        dcp_load(state, storage_reader=reader, no_dist=True)
    assert _equal(state)
    assert reader.loads == []
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "loading without prefetch" in warning
    assert "disabled" in warning  # the attribute the client lacked, named


def test_spanwarm_disable_requests_nothing(
    hf_dir: Path, daemon: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPANWARM_DISABLE", "1")
    reader = PrefetchReader(HuggingFaceStorageReader(str(hf_dir)), client=_waiting(daemon))
    state = _zeros()
    dcp_load(state, storage_reader=reader, no_dist=True)
    assert _equal(state)
    assert reader.loads == []


def test_enable_wraps_inferred_and_explicit_readers_and_puts_torch_back(
    native_dir: Path, hf_dir: Path, daemon: str
) -> None:
    original = state_dict_loader._load_state_dict
    with spanwarm_dcp.prefetch(_waiting(daemon), job="t") as session:
        assert spanwarm_dcp.enable() is session  # idempotent
        state = _zeros()
        dcp_load(state, checkpoint_id=str(native_dir), no_dist=True)
        assert _equal(state)
        explicit = PrefetchReader(HuggingFaceStorageReader(str(hf_dir)), client=_waiting(daemon))
        state = _zeros()
        dcp_load(state, storage_reader=explicit, no_dist=True)  # not wrapped twice
        assert _equal(state)
        state = _zeros()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # deprecated, and still used
            state_dict_loader.load_state_dict(
                state, storage_reader=FileSystemReader(str(native_dir)), no_dist=True
            )
        assert _equal(state)
    assert state_dict_loader._load_state_dict is original
    assert [type(r.reader).__name__ for r in session.readers] == ["FileSystemReader"] * 2
    assert session.readers[0].loads[0].kind == "native"
    assert len(explicit.loads) == 1
    # disabled: the next load is torch's own
    state = _zeros()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_load(state, checkpoint_id=str(native_dir), no_dist=True)
    assert len(session.readers) == 2


def test_the_wrapper_is_a_storage_reader_torch_can_probe(hf_dir: Path) -> None:
    inner = HuggingFaceStorageReader(str(hf_dir))
    reader = PrefetchReader(PrefetchReader(inner))
    assert reader.reader is inner  # never two layers
    # dcp.load looks for **kwargs in these two signatures: they must be the inner one's
    assert reader.read_metadata == inner.read_metadata
    assert reader.set_up_storage_reader == inner.set_up_storage_reader
    assert reader.thread_count == 1  # anything else is the inner reader's
    assert not PrefetchReader.validate_checkpoint_id(str(hf_dir))


def test_a_reader_patched_on_the_instance_keeps_its_own_reads(hf_dir: Path, daemon: str) -> None:
    inner = HuggingFaceStorageReader(str(hf_dir))
    calls: list[str] = []

    def own(f: Any, req: Any, planner: Any) -> None:
        calls.append(req.storage_index.fqn)
        HuggingFaceStorageReader._process_read_request(inner, f, req, planner)

    inner._process_read_request = own  # type: ignore[method-assign]
    reader = PrefetchReader(inner, client=_waiting(daemon))
    state = _zeros()
    dcp_load(state, storage_reader=reader, no_dist=True)
    assert _equal(state)
    assert sorted(calls) == sorted(_originals())  # the user's patch did every read
    assert vars(inner)["_process_read_request"] is own  # and is still there
    assert reader.loads == []  # its reads are its own: not prefetched


def test_a_load_nested_in_a_load_of_the_same_reader(hf_dir: Path, daemon: str) -> None:
    reader = PrefetchReader(HuggingFaceStorageReader(str(hf_dir)), client=_waiting(daemon))
    nested: dict[str, Any] = {"layer0.weight": torch.zeros(64, 96)}

    class Nested(DefaultLoadPlanner):
        def commit_tensor(self, read_item: Any, tensor: Any) -> None:
            super().commit_tensor(read_item, tensor)
            if not nested.get("done"):
                nested["done"] = True
                dcp_load({"layer0.weight": nested["layer0.weight"]}, storage_reader=reader)

    state = _zeros()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_load(state, storage_reader=reader, planner=Nested(), no_dist=True)
    assert _equal(state)
    assert torch.equal(nested["layer0.weight"], _originals()["layer0.weight"])
    assert len(reader.loads) == 1  # the outer load; the inner one read unwaited
    assert reader.loads[0].ticket.progress.ready == 6
    assert "_process_read_request" not in vars(reader.reader)
