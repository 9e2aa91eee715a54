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


def test_state_is_never_set_on_a_class(tmp_path: Path) -> None:
    """pickle's BUILD on a class it named would rebind that class for the whole process."""
    import pathlib

    good = pickle.dumps(torch.Size([1]), protocol=2)
    attr = b"exists"
    rebind = (
        b"cpathlib\nPosixPath\n"  # GLOBAL PosixPath
        + b"N}X"
        + len(attr).to_bytes(4, "little")
        + attr
        + b"ctorch\nSize\ns"  # None, {"exists": torch.Size}
        + b"\x86b0"  # TUPLE2, BUILD, POP
    )
    path = tmp_path / ".metadata"
    path.write_bytes(good[:2] + rebind + good[2:])
    with pytest.raises(MetadataFormatError, match="sets state on type"):
        load_metadata(path)
    assert pathlib.Path("/nonexistent").exists() is False


def test_entries_shared_through_the_memo_are_refused(tmp_path: Path) -> None:
    """A few KiB standing for millions of chunks (one entry under many keys)."""
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    chunk = ChunkStorageMetadata(torch.Size([0]), torch.Size([1]))
    entry = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([1]), [chunk])
    path = tmp_path / ".metadata"
    path.write_bytes(pickle.dumps(Metadata({f"t{i}": entry for i in range(1000)}, storage_data={})))
    with pytest.raises(MetadataFormatError, match="shares its entry"):
        load_metadata(path)


def _plan(directory: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "spanwarm", "plan", str(directory)]
    return subprocess.run(
        [*command, "--world", "1", "--local-world", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_plan_refuses_data_files_outside_the_checkpoint(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    directory = _saved(tmp_path)
    metadata = load_metadata(directory / ".metadata")
    for relative, why in (("/etc/shadow", "is not relative"), ("../../outside", "is outside")):
        metadata.storage_data = {
            index: _StorageInfo(relative, 0, 1) for index in metadata.storage_data
        }
        (directory / ".metadata").write_bytes(pickle.dumps(metadata))
        plan = _plan(directory)
        assert plan.returncode == 1, plan.stderr
        assert why in plan.stderr
        assert "shadow" not in plan.stdout


def test_plan_never_opens_a_fifo_named_like_a_shard(tmp_path: Path) -> None:
    """torch's reader would block forever opening it; spanwarm checks every file first."""
    import os

    from safetensors.torch import save_file

    info = '{"w": {"saved_offsets": [0, 0]}}'
    name = "shard-00001-model-00001-of-00001.safetensors"
    save_file({"w": torch.ones(2, 2)}, str(tmp_path / name), {"DCP_SHARDING_INFO": info})
    os.mkfifo(tmp_path / "zz.safetensors")
    plan = _plan(tmp_path)
    assert plan.returncode == 1, plan.stderr
    assert "zz.safetensors: is not a regular file" in plan.stderr
