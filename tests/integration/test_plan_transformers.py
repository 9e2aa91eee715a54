"""`spanwarm plan MODEL_DIR --tp/--fsdp/--ep`: placements from transformers on meta."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("torch")

from spanwarm.checkpoint.resolve import open_checkpoint
from spanwarm.checkpoint.spans import SpanTable, StridedSpan
from spanwarm.integrations.transformers.whatif import rank_load_spans
from tests.tiny_models import build_model

EXPERT = re.compile(r"\.experts\.\d+\.")


def plan(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "spanwarm", "plan", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def per_expert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model("mixtral", tmp_path_factory.mktemp("plan"), experts=16)["per_expert"]


def test_ep4_over_4_nodes_each_node_warms_a_quarter_of_the_experts(per_expert: Path) -> None:
    checkpoint = open_checkpoint(per_expert)
    expert_names = {n for n in checkpoint.pieces if EXPERT.search(n)}
    expert_bytes = sum(info.nbytes for n in expert_names for _, info in checkpoint.pieces[n])
    owners: dict[str, set[int]] = {}
    for node in range(4):
        ranks = range(node * 4, node * 4 + 4)
        spans = rank_load_spans(
            per_expert, checkpoint, {"fsdp_size": 16, "ep_size": 4}, world=16, ranks=ranks
        )
        node_spans = [s for rank in ranks for s in spans[rank] if s.tensor in expert_names]
        for s in node_spans:
            owners.setdefault(s.tensor, set()).add(node)
        by_file: dict[str, list[StridedSpan]] = {}
        for s in node_spans:
            by_file.setdefault(s.path, []).append(s.span)
        needed = sum(SpanTable.of(spans).covered_bytes() for spans in by_file.values())
        assert needed == expert_bytes // 4, (node, needed, expert_bytes)
    # Every expert tensor is read whole by exactly one node (the seed read all of them on each).
    assert set(owners) == expert_names
    assert all(len(nodes) == 1 for nodes in owners.values())


def test_plan_command_on_a_model_directory(per_expert: Path) -> None:
    total = sum(h.file_size for h in open_checkpoint(per_expert).headers)
    run = plan(
        str(per_expert),
        "--fsdp",
        "16",
        "--ep",
        "4",
        "--nodes",
        "4",
        "--local-world",
        "4",
        "--node",
        "2",
        "--seek-cost",
        "0",
        "--json",
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert result["ranks"] == [8, 9, 10, 11]
    # Everything is sharded 16 ways and the node holds 4 ranks: about a quarter of the bytes.
    assert 0.2 * total < result["needed_bytes"] < 0.3 * total
    table = plan(str(per_expert), "--tp", "4", "--local-world", "4")
    assert table.returncode == 0, table.stderr
    assert table.stdout.startswith("node 0: ranks 0..3")


def test_the_plan_warms_what_the_ranks_ask_for_their_slices_first_pages_too(
    per_expert: Path,
) -> None:
    """A node's plan is what its ranks request: the rows they copy and the page of each
    sliced tensor's first byte (TP rank 1 holds no first rows: each slice faults that
    page in), plus each file's header."""
    checkpoint = open_checkpoint(per_expert)
    run = plan(
        str(per_expert),
        "--tp",
        "4",
        "--local-world",
        "1",
        "--node",
        "1",
        "--seek-cost",
        "0",
        "--json",
    )
    assert run.returncode == 0, run.stderr
    needed = json.loads(run.stdout)["needed_bytes"] - sum(h.data_start for h in checkpoint.headers)

    def covered(first_pages: bool) -> int:
        (spans,) = rank_load_spans(
            per_expert, checkpoint, {"tp_size": 4}, world=4, ranks=[1], first_pages=first_pages
        ).values()
        by_file: dict[str, list[StridedSpan]] = {}
        for s in spans:
            by_file.setdefault(s.path, []).append(s.span)
        return sum(SpanTable.of(spans).covered_bytes() for spans in by_file.values())

    assert needed == covered(first_pages=True) > covered(first_pages=False)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--fsdp", "4", "--ep", "3", "--local-world", "4"], "`ep_size` must divide"),
        (["--fsdp", "4", "--local-world", "3"], "--local-world 3 does not divide the 4 ranks"),
        (["--fsdp", "4", "--local-world", "2", "--node", "2"], "--node 2 is outside 0..1"),
        (["--tp", "0", "--local-world", "1"], "must be >= 1"),
        (["--fsdp", "4", "--world", "8", "--local-world", "4"], "8 ranks in all, but the sizes"),
        (["--fsdp", "4", "--nodes", "4", "--local-world", "2"], "8 ranks in all, but the sizes"),
        (["--tp", "2", "--local-world", "2", "--place", "x=Shard(0)"], "do not apply"),
    ],
)
def test_plan_command_refuses_bad_parallelism(
    per_expert: Path, args: list[str], message: str
) -> None:
    run = plan(str(per_expert), *args)
    assert run.returncode == 2
    assert message in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr


def test_plan_command_needs_a_model_directory_for_parallel_sizes(tmp_path: Path) -> None:
    checkpoint = next(iter(build_model("starcoder2", tmp_path).values()))
    (checkpoint / "config.json").unlink()
    run = plan(str(checkpoint), "--tp", "2", "--local-world", "2")
    assert run.returncode == 2
    assert "has no config.json" in run.stderr
