"""SGLang 0.5's ``DefaultModelLoader.load_model`` loading through the spanwarm plugin, in
rank processes as a server's schedulers run it (``sglang_load.py``: SGLang's parallel
state on gloo, ``load_plugins()`` finding the plugin through its installed entry point).

What each rank really reads is recorded independently of spanwarm: the checkpoint is
served by a FUSE mount (``spanwarm.testing.slowfs``) with the kernel's read-ahead off, so every page
a rank's weight loaders fault in is one read request of that rank's process, in the
mount's trace. The ranks load one after another, each from a cold page cache. The
plugin's request of each rank (``SPANWARM_SGLANG_SPANS_DIR``) must name exactly those
pages: coverage 100%, over-fetch 1.00. With a real daemon, the ranks then read no page
of a tensor from storage themselves. Every load's parameters are checked against the
checkpoint (fused qkv and gate_up: the concatenation of the rank's shards).
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests import server_loads
from tests.daemon_harness import running_daemon
from tests.server_loads import UNSET, pages_read, requested_pages, run_with_plugin
from tests.sglang.tiny_sglang_model import expected_parameters, write_llama

pytestmark = pytest.mark.timeout(600)

LOAD = Path(__file__).with_name("sglang_load.py")
STUBS = Path(__file__).with_name("stubs")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_llama(tmp_path_factory.mktemp("models") / "llama")


def load(model: Path, out: Path, *flags: str, **env: str) -> str:
    """Run sglang_load.py with the plugin switched on (``env`` on top, ``UNSET``: not set);
    returns its log."""
    out.mkdir()
    done, log = run_with_plugin(
        "SPANWARM_SGLANG",
        [sys.executable, str(LOAD), str(model), str(out), *flags],
        out,
        paths=[STUBS],
        timeout=500,
        env=env,
    )
    assert done.returncode == 0, log[-4000:]
    return log


def assert_loaded(model: Path, out: Path, tp: int) -> None:
    """Every rank's parameters are the checkpoint's (its shards of them)."""
    for rank in range(tp):
        loaded = torch.load(out / f"weights-{rank}.pt")
        expected = expected_parameters(model, rank, tp)
        assert sorted(loaded) == sorted(expected)
        for name, tensor in expected.items():
            assert torch.equal(loaded[name], tensor), f"rank {rank}: {name}"


def touched_pages(trace: Path, out: Path) -> dict[int, dict[str, set[int]]]:
    """Per rank (its process, as the load script recorded it), per file: the pages its
    process read from the mount."""
    ranks = {}
    for path in out.glob("proc-*.json"):
        record = json.loads(path.read_text())
        ranks[record["pid"]] = record["rank"]
    return pages_read(trace, ranks)


def assert_exact(out: Path, trace: Path, model: Path, ranks: int) -> None:
    server_loads.assert_exact(requested_pages(out), touched_pages(trace, out), model, ranks)


def assert_read_warm(trace: Path, out: Path, model: Path, ranks: int) -> None:
    server_loads.assert_read_warm(touched_pages(trace, out), model, ranks)


def test_tp2_requests_exactly_what_each_rank_reads_and_loads_it_warm(
    model: Path, traced: Any, tmp_path: Path
) -> None:
    """TP2 over gloo, SGLang's default (multi-threaded, buffered) iterator."""
    # Cold: the plugin only tells what it would ask for (SPANWARM_DISABLE).
    mounted, trace = traced(model)
    load(mounted, tmp_path / "cold", "--tp", "2", "--serial", SPANWARM_DISABLE="1")
    assert_loaded(model, tmp_path / "cold", tp=2)
    assert_exact(tmp_path / "cold", trace, model, ranks=2)
    requested = requested_pages(tmp_path / "cold")
    assert requested[0] != requested[1]  # TP2 splits; the norms are read by both

    # Warm, with a real daemon: the ranks read no tensor page from storage themselves.
    mounted, trace = traced(model)
    with running_daemon() as daemon:
        log = load(
            mounted,
            tmp_path / "warm",
            "--tp",
            "2",
            SPANWARM_SOCKET=daemon.socket,
            SPANWARM_SGLANG_READ_YOURSELF="0",
        )
    assert_loaded(model, tmp_path / "warm", tp=2)
    assert requested_pages(tmp_path / "warm") == requested
    assert_read_warm(trace, tmp_path / "warm", model, ranks=2)
    # The request went out before the model was built, and the load was gated.
    assert "spanwarm: rank 0 reads 21 tensors" in log
    assert "spanwarm: rank 1 reads 21 tensors" in log


def test_tp1_single_threaded_iterator_exact_and_warm(
    model: Path, traced: Any, tmp_path: Path
) -> None:
    """``enable_multithread_load: false``: SGLang's other safetensors iterator."""
    mounted, trace = traced(model)
    load(mounted, tmp_path / "cold", "--single-thread", SPANWARM_DISABLE="1")
    assert_loaded(model, tmp_path / "cold", tp=1)
    assert_exact(tmp_path / "cold", trace, model, ranks=1)

    mounted, trace = traced(model)
    with running_daemon() as daemon:
        load(
            mounted,
            tmp_path / "warm",
            "--single-thread",
            SPANWARM_SOCKET=daemon.socket,
            SPANWARM_SGLANG_READ_YOURSELF="0",
        )
    assert_loaded(model, tmp_path / "warm", tp=1)
    assert requested_pages(tmp_path / "warm") == requested_pages(tmp_path / "cold")
    assert_read_warm(trace, tmp_path / "warm", model, ranks=1)


def test_without_switch_or_working_daemon_loads_as_without_spanwarm(
    model: Path, tmp_path: Path
) -> None:
    """The switch off: nothing installed, no request. No daemon, or a frozen one: the
    checkpoint's weights all the same."""
    log = load(model, tmp_path / "off", SPANWARM_SGLANG=UNSET)
    assert_loaded(model, tmp_path / "off", tp=1)
    assert "spanwarm:" not in log
    assert "plugin=spanwarm" not in log  # no hook registered
    assert "Executed general plugin: spanwarm" in log  # though SGLang found it
    assert not list((tmp_path / "off").glob("rank-*.json"))

    # No daemon; then loads spanwarm does not warm: one line each, the load unchanged.
    absent = tmp_path / "absent"
    log = load(
        model,
        absent,
        "--then-no-mmap",
        "--then-dummy",
        SPANWARM_SOCKET=str(tmp_path / "no-daemon.sock"),
    )
    assert_loaded(model, absent, tp=1)
    assert log.count("spanwarm: rank 0 reads") == 1  # the first load's request only
    assert log.count("spanwarm: --weight-loader-disable-mmap reads whole files") == 1
    assert log.count("spanwarm: load format 'dummy' (DummyModelLoader) reads through") == 1
    expected = expected_parameters(model, 0, 1)
    no_mmap = torch.load(absent / "weights-0-no-mmap.pt")
    assert all(torch.equal(no_mmap[name], tensor) for name, tensor in expected.items())

    with running_daemon() as daemon:
        daemon.process.send_signal(signal.SIGSTOP)
        try:
            load(model, tmp_path / "frozen", SPANWARM_SOCKET=daemon.socket)
        finally:
            daemon.process.send_signal(signal.SIGCONT)
    assert_loaded(model, tmp_path / "frozen", tp=1)
