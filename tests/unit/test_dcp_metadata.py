"""A DCP ``.metadata`` file is read by spanwarm without running anything it names."""

from __future__ import annotations

import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from torch.distributed.checkpoint.state_dict_saver import save as dcp_save  # noqa: E402

from spanwarm.errors import MetadataFormatError  # noqa: E402
from spanwarm.integrations.dcp.metadata import load_metadata  # noqa: E402


class _Runs:
    """Unpickling this calls ``os.system``: what a planted ``.metadata`` would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        import os

        return os.system, (f"touch {self.marker}",)


def _saved(tmp_path: Path) -> Path:
    state = {"w": torch.arange(12.0).reshape(3, 4), "step": 7, "b": torch.ones(2).bfloat16()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_save(state, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    return tmp_path / "ckpt"


def test_real_metadata_loads_as_torch_reads_it(tmp_path: Path) -> None:
    path = _saved(tmp_path) / ".metadata"
    ours = load_metadata(path)
    theirs = pickle.loads(path.read_bytes())
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert ours.storage_data == theirs.storage_data


def test_a_planted_metadata_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    path = _saved(tmp_path) / ".metadata"
    path.write_bytes(pickle.dumps({"state_dict_metadata": _Runs(marker)}))
    with pytest.raises(MetadataFormatError, match=r"names posix\.system"):
        load_metadata(path)
    assert not marker.exists()
    # the what-if on that directory: exit 1, one line naming the file, nothing run
    command = [sys.executable, "-m", "spanwarm", "plan", str(path.parent)]
    plan = subprocess.run(
        [*command, "--world", "2", "--local-world", "2"],
        capture_output=True,
        text=True,
    )
    assert plan.returncode == 1
    assert str(path) in plan.stderr
    assert "never holds" in plan.stderr
    assert not marker.exists()


@pytest.mark.parametrize(
    "content", [b"", b"not a pickle", pickle.dumps({"a": 1}), pickle.dumps([1, 2])]
)
def test_what_is_not_metadata_is_refused(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / ".metadata"
    path.write_bytes(content)
    with pytest.raises(MetadataFormatError, match="not"):
        load_metadata(path)
