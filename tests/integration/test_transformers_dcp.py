"""transformers' distributed checkpoints, prefetched by ``spanwarm_tf.enable()``.

A tiny Llama and a per-expert Mixtral, loaded under TP2 x FSDP2 and saved with
``save_pretrained(..., distributed_checkpoint=True)``, load back under TP4 and FSDP4
(``_load_and_finalize_distributed_pretrained_model``: one ``dcp.load`` of the
redistributed state dict) on 4 gloo ranks with a real daemon. Per rank and case: the
load went through DCP's reader and was prefetched, every byte it read was requested, at
most 1.05x of it was requested, the daemon warmed every item, and every weight equals the
original.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("torch")

from tests.integration.test_dcp_integration import _covered, _union_bytes
from tests.integration.torchrun import RANKS, run_ranks
from tests.tiny_models import build_model, reference_path

WORKER = Path(__file__).with_name("transformers_dcp_rank.py")
MODELS = (("llama", "dense"), ("mixtral", "per_expert"))
CASES = [f"{m}-{layout}-{loaded}" for m, layout in MODELS for loaded in ("tp4", "fsdp4")]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tfdcp")
    cases = []
    for model, layout in MODELS:
        directory = build_model(model, root)[layout]
        cases.append(
            {
                "name": f"{model}-{layout}",
                "dir": str(directory),
                "reference": str(reference_path(directory)),
            }
        )
    (root / "cases.json").write_text(json.dumps(cases))
    run_ranks(WORKER, str(root / "cases.json"), str(root))
    return root


@pytest.mark.torchrun
@pytest.mark.parametrize("case", CASES)
def test_distributed_checkpoint_loads_request_what_they_read(loaded: Path, case: str) -> None:
    for rank in range(RANKS):
        result = json.loads((loaded / f"{case}.rank{rank}.json").read_text())
        assert result["loads"] == 1, rank
        assert result["dcp"], rank  # through DCP's reader, prefetched
        assert result["compared"] > 0
        assert result["mismatched"] == [], (rank, result["mismatched"])
        assert result["failures"] == {}, rank
        assert result["warnings"] == [], rank
        assert result["ready"] == result["groups"] > 0, rank
        read_bytes, requested_bytes = _covered(result)
        assert read_bytes > 0
        assert requested_bytes <= 1.05 * read_bytes, (rank, requested_bytes, read_bytes)


@pytest.mark.torchrun
def test_plan_of_a_transformers_distributed_checkpoint(loaded: Path) -> None:
    """`spanwarm plan DCP_DIR --fsdp 4`: per file, what node 0 needs is the union of what
    the 4 ranks of the real FSDP4 load requested."""
    plan = subprocess.run(
        [
            *(sys.executable, "-m", "spanwarm", "plan", str(loaded / "llama-dense-dcp")),
            *("--fsdp", "4", "--local-world", "4", "--json"),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    needed = {f["path"]: f["needed_bytes"] for f in json.loads(plan.stdout)["files"]}
    results = [
        json.loads((loaded / f"llama-dense-fsdp4.rank{r}.json").read_text()) for r in range(RANKS)
    ]
    assert {p: n for p, n in needed.items() if n} == _union_bytes(results)
