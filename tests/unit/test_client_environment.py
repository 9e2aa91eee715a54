"""What the environment says about a rank's requests: off, whose job, which rank."""

from __future__ import annotations

import pytest

from spanwarm.client.environment import disabled_by_environment, job_id, this_rank


@pytest.mark.parametrize(
    ("value", "disabled"),
    [(None, False), ("", False), ("0", False), ("1", True), ("yes", True)],
)
def test_spanwarm_disable_turns_requests_off_unless_empty_or_0(
    monkeypatch: pytest.MonkeyPatch, value: str | None, disabled: bool
) -> None:
    if value is None:
        monkeypatch.delenv("SPANWARM_DISABLE", raising=False)
    else:
        monkeypatch.setenv("SPANWARM_DISABLE", value)
    assert disabled_by_environment() is disabled


def test_the_job_is_named_by_the_caller_then_spanwarm_then_torchrun(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("SPANWARM_JOB", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert job_id() == "default"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-7")
    assert job_id() == "run-7"
    monkeypatch.setenv("SPANWARM_JOB", "train")
    assert job_id() == "train"
    assert job_id("mine") == "mine"


def test_the_rank_comes_from_rank_without_a_process_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("RANK", raising=False)
    assert this_rank() == 0
    monkeypatch.setenv("RANK", "5")
    assert this_rank() == 5
