"""torchtitan 0.3.0's own checkpoint loading, prefetched by one ``enable()`` line.

``CheckpointManager.load`` on 4 gloo CPU ranks with a real daemon (``torchtitan_rank.py``):
the HF import (``initial_load_in_hf``: ``dcp.load`` with its adapter's
``HuggingFaceStorageReader``) and the resume from a native DCP step (``dcp.load`` with
``checkpoint_id``). Per rank: one prefetched load, every byte read was requested, at most
1.05x of it was requested, every item was warm, and the weights are the originals.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("torchtitan", reason="make test installs torchtitan 0.3.0 (--no-deps)")

from tests.integration.test_dcp_integration import _covered
from tests.integration.torchrun import RANKS, run_ranks

WORKER = Path(__file__).with_name("torchtitan_rank.py")


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("titan")
    run_ranks(WORKER, str(root))
    return root


@pytest.mark.torchrun
@pytest.mark.parametrize(
    ("case", "kind"), [("titan-hf-import", "safetensors"), ("titan-dcp-resume", "native")]
)
def test_torchtitan_loads_are_prefetched_exactly(loaded: Path, case: str, kind: str) -> None:
    for rank in range(RANKS):
        result = json.loads((loaded / f"{case}.rank{rank}.json").read_text())
        assert result["loads"] == 1, rank
        assert result["kind"] == kind, rank
        assert result["mismatched"] == [], (rank, result["mismatched"])
        assert result["warnings"] == [], rank
        assert result["failures"] == {}, rank
        assert result["ready"] == result["groups"] > 0, rank
        read_bytes, requested_bytes = _covered(result)
        assert read_bytes > 0
        assert requested_bytes <= 1.05 * read_bytes, (rank, requested_bytes, read_bytes)
