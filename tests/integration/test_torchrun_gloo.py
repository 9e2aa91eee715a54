"""rank_spans in 4 real processes under torchrun with gloo (one test: each costs seconds)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from safetensors.torch import save_file  # noqa: E402

from tests.integration.torchrun import rank_env  # noqa: E402

WORKER = Path(__file__).with_name("gloo_rank_worker.py")


@pytest.mark.torchrun
def test_spans_read_back_each_ranks_local_tensor(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(1)
    weights = {
        "w_rowwise": torch.randn(12, 6, generator=gen).to(torch.bfloat16),
        "w_colwise": torch.randn(5, 10, generator=gen),
        "w_mixed": torch.randn(7, 9, generator=gen).to(torch.float16),
    }
    checkpoint = tmp_path / "model.safetensors"
    save_file(weights, str(checkpoint))
    torch.save(weights, checkpoint.with_suffix(".pt"))
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "4",
            str(WORKER),
            str(checkpoint),
            str(tmp_path),
        ],
        env=rank_env(),
        timeout=240,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr[-6000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for name, tensor in weights.items():
        assert all(r[name]["equal"] for r in results), name
        held = sum(r[name]["bytes"] for r in results)
        replication = 2 if name == "w_colwise" else 1
        assert held == replication * tensor.numel() * tensor.element_size(), name
    # Replicate x Shard(1): one strided span per rank, not one per row.
    assert [r["w_colwise"]["spans"] for r in results] == [1, 1, 1, 1]
