"""The generated gRPC code is exactly what scripts/gen_protos.py makes from protos/."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def check(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(root / "scripts" / "gen_protos.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )


def test_checked_in_code_is_fresh() -> None:
    result = check(ROOT)
    assert result.returncode == 0, result.stderr


def test_a_changed_proto_makes_the_check_fail(tmp_path: Path) -> None:
    for part in ("scripts", "protos", "src/spanwarm/rpc"):
        shutil.copytree(ROOT / part, tmp_path / part)
    proto = tmp_path / "protos" / "spanwarm" / "v1" / "warmer.proto"
    proto.write_text(
        proto.read_text().replace("message Done {", "message Done {\n  uint32 extra = 9;")
    )
    result = check(tmp_path)
    assert result.returncode == 1
    assert "is stale (warmer_pb2.py" in result.stderr
