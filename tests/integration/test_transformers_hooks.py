"""Installing and removing the transformers hooks; what happens when an internal is gone."""

from __future__ import annotations

import inspect
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers import modeling_utils  # noqa: E402
from transformers.modeling_utils import PreTrainedModel  # noqa: E402

import spanwarm.integrations.transformers as spanwarm_tf  # noqa: E402
from spanwarm.integrations.transformers import loading  # noqa: E402

CONVERT = "convert_and_load_state_dict_in_model"


DCP_LOAD = "_load_and_finalize_distributed_pretrained_model"


def _hooks() -> tuple[object, object, object]:
    return (
        inspect.getattr_static(PreTrainedModel, "_load_pretrained_model"),
        getattr(modeling_utils, CONVERT),
        getattr(PreTrainedModel, DCP_LOAD),
    )


def test_prefetch_installs_its_hooks_and_puts_transformers_back() -> None:
    before = _hooks()
    with spanwarm_tf.prefetch() as session:
        assert session.active
        during = _hooks()
        assert during[0] is not before[0]
        assert during[1] is not before[1]
        assert during[2] is not before[2]  # distributed checkpoints: DCP, prefetched
        assert spanwarm_tf.enable() is session  # idempotent
    assert _hooks() == before
    assert DCP_LOAD not in vars(PreTrainedModel)  # the mixin's own, inherited again


def test_a_missing_internal_disables_the_integration_with_one_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    before = _hooks()
    monkeypatch.setattr(loading, "_warned", False)
    monkeypatch.delattr(modeling_utils, CONVERT)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = spanwarm_tf.enable()
        second = spanwarm_tf.enable()
    assert not first.active
    assert not second.active
    assert len(caught) == 1
    assert CONVERT in str(caught[0].message)
    assert "loads without prefetch" in str(caught[0].message)
    assert inspect.getattr_static(PreTrainedModel, "_load_pretrained_model") is before[0]


def test_disable_mmap_loads_request_whole_files_in_read_order(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    torch = pytest.importorskip("torch")
    first, second = tmp_path / "b.safetensors", tmp_path / "a.safetensors"
    save_file({"z": torch.zeros(64), "y": torch.ones(3, 5)}, str(first))
    save_file({"x": torch.zeros(7)}, str(second))
    files, config = [str(first), str(second)], SimpleNamespace(disable_mmap=True)
    assert loading._reads_whole_files(files, config)
    spans = loading._load_spans(None, files, config, whole_files=True)
    assert [(Path(s.path).name, s.tensor) for s in spans] == [
        ("b.safetensors", "y"),
        ("b.safetensors", "z"),
        ("a.safetensors", "x"),
    ]
    for path in (first, second):
        mine = [s for s in spans if s.path == str(path)]
        data_start = mine[0].offset
        assert sum(s.length * s.count for s in mine) == path.stat().st_size - data_start
