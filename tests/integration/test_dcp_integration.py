"""torch DCP loads prefetched by spanwarm, against what torch itself reads.

4 gloo CPU ranks under torchrun and a real daemon (``dcp_rank.py``): a 2x2-mesh state
dict saved as distributed HF safetensors, as the same consolidated, and in DCP's native
format, loaded into TP4 and FSDP4 through ``PrefetchReader`` and through ``enable()``;
an fp8 checkpoint through ``QuantizedHuggingFaceStorageReader``; and one load with no
daemon. Per rank and case: every byte torch read was requested, at most 1.05x of it was
requested, the daemon reported every item warm, and the loaded values are the originals.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from tests.integration.test_transformers_integration import PAGE, _intervals, _pages, _uncovered
from tests.integration.torchrun import RANKS, run_ranks

WORKER = Path(__file__).with_name("dcp_rank.py")
CASES = [
    f"{fmt}-{layout}-{how}"
    for fmt in ("hf", "hf_consolidated", "native")
    for layout in ("tp4", "fsdp4")
    for how in ("reader", "enable")
] + ["fp8-tp4-reader"]
KINDS = {"hf": "safetensors", "hf_consolidated": "safetensors", "native": "native"}


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dcp")
    run_ranks(WORKER, str(root))
    return root


def _result(root: Path, case: str, rank: int) -> dict[str, Any]:
    result: dict[str, Any] = json.loads((root / f"{case}.rank{rank}.json").read_text())
    return result


def _covered(result: dict[str, Any]) -> tuple[int, int]:
    """(bytes read, bytes requested), asserting every read byte was requested, and some
    byte of each page a safetensors slice faults in at its tensor's first byte."""
    read_bytes = requested_bytes = 0
    for path in set(result["reads"]) | set(result["requested"]):
        reads = _intervals(result["reads"].get(path, []))
        requested = _intervals(result["requested"].get(path, []))
        assert _uncovered(reads, requested) == 0, path
        touched = result.get("touched", {}).get(path, [])
        assert {start // PAGE for start, _ in touched} <= _pages(requested), path
        faulted = _intervals([*result["reads"].get(path, []), *touched])
        read_bytes += int((faulted[:, 1] - faulted[:, 0]).sum())
        requested_bytes += int((requested[:, 1] - requested[:, 0]).sum())
    return read_bytes, requested_bytes


@pytest.mark.torchrun
@pytest.mark.parametrize("case", CASES)
def test_requested_spans_cover_exactly_what_dcp_reads(loaded: Path, case: str) -> None:
    fmt = case.split("-")[0]
    total_read = 0
    for rank in range(RANKS):
        result = _result(loaded, case, rank)
        assert result["kind"] == KINDS.get(fmt, "quantized"), rank
        assert result["mismatched"] == [], (rank, result["mismatched"])
        assert result["failures"] == {}, rank
        assert result["warnings"] == [], rank
        assert result["ready"] == result["groups"] > 0, rank
        read_bytes, requested_bytes = _covered(result)
        assert requested_bytes <= 1.05 * read_bytes, (rank, requested_bytes, read_bytes)
        total_read += read_bytes
    assert total_read > 0


@pytest.mark.torchrun
def test_enable_requests_what_the_explicit_reader_does(loaded: Path) -> None:
    for case in CASES:
        if not case.endswith("-enable"):
            continue
        for rank in range(RANKS):
            enabled = _result(loaded, case, rank)
            explicit = _result(loaded, case.replace("-enable", "-reader"), rank)
            assert enabled["requested"] == explicit["requested"], (case, rank)
            assert enabled["requested_order"] == explicit["requested_order"], (case, rank)


@pytest.mark.torchrun
def test_quantized_reader_requests_the_scales_it_reads(loaded: Path) -> None:
    for rank in range(RANKS):
        result = _result(loaded, "fp8-tp4-reader", rank)
        scales = [p for p in result["reads"] if p.endswith("model-00002-of-00002.safetensors")]
        assert scales, "the weight_scale_inv file was read"
        assert set(scales) <= set(result["requested"])


@pytest.mark.torchrun
def test_without_a_daemon_the_load_is_unchanged(loaded: Path) -> None:
    for rank in range(RANKS):
        result = _result(loaded, "no-daemon", rank)
        with_daemon = _result(loaded, "hf-tp4-reader", rank)
        assert result["mismatched"] == []
        assert {p: sorted(r) for p, r in result["reads"].items()} == {
            p: sorted(r) for p, r in with_daemon["reads"].items()
        }
        assert result["groups"] > 0
        assert result["ready"] == 0  # released, never reported warm
        assert len(result["warnings"]) == 1, result["warnings"]
        assert "daemon" in result["warnings"][0]


def _union_bytes(results: list[dict[str, Any]]) -> dict[str, int]:
    """Per file, the bytes in the union of what these ranks requested, plus its header
    when it is safetensors (every rank's reader reads the headers first, for metadata)."""
    pairs: dict[str, list[list[int]]] = {}
    for result in results:
        for path, intervals in result["requested"].items():
            pairs.setdefault(path, []).extend(intervals)
    return {
        path: int((merged[:, 1] - merged[:, 0]).sum()) + _header_bytes(path)
        for path, merged in ((p, _intervals(i)) for p, i in pairs.items())
    }


def _header_bytes(path: str) -> int:
    if not path.endswith(".safetensors"):
        return 0
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


@pytest.mark.torchrun
@pytest.mark.parametrize("fmt", ["hf", "native"])
def test_plan_of_a_dcp_directory_is_what_its_ranks_requested(loaded: Path, fmt: str) -> None:
    """`spanwarm plan DCP_DIR` with the FSDP4 layout the loads used: per file, the bytes
    it says node 0 needs are the union of what the 4 ranks' real loads requested."""
    plan = subprocess.run(
        [
            sys.executable,
            "-m",
            "spanwarm",
            "plan",
            str(loaded / fmt),
            "--world",
            "4",
            "--local-world",
            "4",
            "--place",
            ".=Shard(0)",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    needed = {f["path"]: f["needed_bytes"] for f in json.loads(plan.stdout)["files"]}
    requested = _union_bytes([_result(loaded, f"{fmt}-fsdp4-reader", r) for r in range(RANKS)])
    assert {p: n for p, n in needed.items() if n} == requested
