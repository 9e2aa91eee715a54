"""``spanwarm plan`` as users run it: the seed's repro table, JSON shape, errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from spanwarm.checkpoint.samples import seed_repro_checkpoints

MiB = 2**20
PACKED_RULE = r"experts\.gate_up_proj=Shard(0)"


def plan(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "spanwarm", "plan", *args],
        capture_output=True,
        text=True,
        check=False,
    )


def plan_json(*args: str) -> dict[str, Any]:
    result = plan(*args, "--json")
    assert result.returncode == 0, result.stderr
    document: dict[str, Any] = json.loads(result.stdout)
    return document


@pytest.fixture(scope="module")
def repro(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return seed_repro_checkpoints(tmp_path_factory.mktemp("repro"))


@pytest.mark.parametrize(
    ("nodes", "packed_mib", "packed_decision"),
    [(1, 512, "whole"), (2, 256, "spans"), (4, 128, "spans")],
)
def test_seed_repro_table(
    repro: tuple[Path, Path], nodes: int, packed_mib: int, packed_decision: str
) -> None:
    packed, per_expert = repro
    local_world = 4 // nodes
    for node in range(nodes):
        args = ["--world", "4", "--local-world", str(local_world), "--node", str(node)]
        doc = plan_json(str(packed), *args, "--place", PACKED_RULE)
        (f,) = doc["files"]
        assert f["decision"] == packed_decision
        # Tensor bytes plus the file's header, which the loader reads first.
        header = f["size_bytes"] - 512 * MiB
        assert f["warm_bytes"] == packed_mib * MiB + header
        assert f["num_runs"] == (1 if nodes == 1 else 3 if node else 2)
        assert doc["ranks"] == list(range(node * local_world, (node + 1) * local_world))

        # The packed rule names no per-expert tensor: each is replicated, the file read whole.
        (f,) = plan_json(str(per_expert), *args, "--place", PACKED_RULE)["files"]
        assert (f["decision"], f["warm_bytes"]) == ("whole", f["size_bytes"])


def test_json_shape(repro: tuple[Path, Path]) -> None:
    doc = plan_json(
        str(repro[0].parent),
        "--world",
        "8",
        "--local-world",
        "2",
        "--mesh",
        "2x4",
        "--seek-cost",
        "1MiB",
        "--place",
        r"gate_up=[Replicate(),_StridedShard(0,sf=2)]",
    )
    assert set(doc) == {"node", "ranks", "seek_cost_bytes", "needed_bytes", "warm_bytes", "files"}
    assert doc["seek_cost_bytes"] == MiB
    assert [Path(f["path"]).name for f in doc["files"]] == [
        "packed.safetensors",
        "per_expert.safetensors",
    ]
    for f in doc["files"]:
        assert set(f) == {
            "path",
            "size_bytes",
            "needed_bytes",
            "num_runs",
            "cost_bytes",
            "decision",
            "warm_bytes",
        }
    assert doc["warm_bytes"] == sum(f["warm_bytes"] for f in doc["files"])


def test_table_is_the_default(repro: tuple[Path, Path]) -> None:
    result = plan(str(repro[0]), "--world", "4", "--local-world", "1", "--place", PACKED_RULE)
    assert result.returncode == 0
    assert "packed.safetensors" in result.stdout
    assert "128.0 MiB" in result.stdout
    assert "spans" in result.stdout


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--world", "4"], "required: --local-world"),
        (["--world", "4", "--local-world", "3"], "multiple of --local-world"),
        (["--world", "4", "--local-world", "2", "--node", "2"], "--node 2 is outside 0..1"),
        (["--world", "4", "--local-world", "2", "--mesh", "3x3"], "does not hold 4 ranks"),
        (["--world", "4", "--local-world", "2", "--mesh", "4x"], "is not like 4 or 2x4"),
        (["--world", "4", "--local-world", "2", "--seek-cost", "12 parsecs"], "not a byte size"),
        (
            ["--world", "4", "--local-world", "2", "--place", "x=Shard(q)"],
            "cannot parse placements",
        ),
        (["--world", "4", "--local-world", "2", "--place", "noequals"], "REGEX=PLACEMENTS"),
        (
            ["--world", "4", "--local-world", "2", "--place", "x=[Shard(0),Shard(0)]"],
            "2 placements for a 1-d mesh",
        ),
        (
            ["--world", "4", "--local-world", "2", "--place", "gate=Shard(3)"],
            "does not fit a 3-d tensor",
        ),
    ],
)
def test_bad_arguments_exit_2_with_one_line(
    repro: tuple[Path, Path], args: list[str], fragment: str
) -> None:
    result = plan(str(repro[0]), *args)
    assert result.returncode == 2
    assert result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert fragment in result.stderr


def test_bad_checkpoint_exits_1_naming_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x01")
    result = plan(str(bad), "--world", "1", "--local-world", "1")
    assert result.returncode == 1
    assert (
        result.stderr.strip()
        == f"spanwarm plan: {bad}: file is 1 bytes, shorter than the 8-byte prefix"
    )


def test_console_script_is_installed(repro: tuple[Path, Path]) -> None:
    exe = Path(sys.executable).parent / "spanwarm"
    result = subprocess.run(
        [str(exe), "plan", str(repro[0]), "--world", "2", "--local-world", "1", "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["files"][0]["decision"] == "whole"
