"""SGLang 0.5's ``DefaultModelLoader.load_model`` loading through the spanwarm plugin, in
rank processes as a server's schedulers run it (``sglang_load.py``: SGLang's parallel
state on gloo, ``load_plugins()`` finding the plugin through its installed entry point).

What each rank really reads is recorded independently of spanwarm: the checkpoint is
served by a FUSE mount (``bench.slowfs``) with the kernel's read-ahead off, so every page
a rank's weight loaders fault in is one read request of that rank's process, in the
mount's trace. The ranks load one after another, each from a cold page cache. The
plugin's request of each rank (``SPANWARM_SGLANG_SPANS_DIR``) must name exactly those
pages: coverage 100%, over-fetch 1.00. With a real daemon, the ranks then read no page
of a tensor from storage themselves. Every load's parameters are checked against the
checkpoint (fused qkv and gate_up: the concatenation of the rank's shards).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.span_pages import pages_by_file
from spanwarm.residency import PAGE
from spanwarm.safetensors_header import read_header
from tests.daemon_harness import running_daemon
from tests.sglang.tiny_sglang_model import expected_parameters, write_llama

pytestmark = pytest.mark.timeout(600)

REPO = Path(__file__).parents[2]
LOAD = Path(__file__).with_name("sglang_load.py")
STUBS = Path(__file__).with_name("stubs")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_llama(tmp_path_factory.mktemp("models") / "llama")


@pytest.fixture
def traced(tmp_path: Path) -> Iterator[Any]:
    """Mount a model on FUSE with read-ahead off: ``traced(model) -> (mount, trace)``."""
    from bench.slowfs import fuse_available, mount

    if (reason := fuse_available()) is not None:
        pytest.skip(reason)
    if os.geteuid() != 0:
        pytest.skip("turning the mount's read-ahead off needs root")
    stack: list[Any] = []

    def mounted(model: Path) -> tuple[Path, Path]:
        n = len(stack)
        trace = tmp_path / f"trace-{n}.jsonl"
        context = mount(model, tmp_path / f"mnt-{n}", read_ahead_kb=0, trace=trace)
        fs = context.__enter__()
        stack.append(context)
        return fs.path(""), trace

    yield mounted
    for context in reversed(stack):
        context.__exit__(None, None, None)


def load(model: Path, out: Path, *flags: str, **env: str) -> str:
    """Run sglang_load.py with the plugin switched on (``env`` on top); returns its log."""
    environ = {
        **os.environ,
        "SPANWARM_SGLANG": "1",
        "SPANWARM_SGLANG_SPANS_DIR": str(out),
        "PYTHONPATH": os.pathsep.join([str(REPO), str(STUBS)]),
        **env,
    }
    environ = {k: v for k, v in environ.items() if v is not None and v != "<unset>"}
    out.mkdir()
    done = subprocess.run(
        [sys.executable, str(LOAD), str(model), str(out), *flags],
        env=environ,
        capture_output=True,
        text=True,
        timeout=500,
        check=False,
    )
    log = done.stdout + done.stderr
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


def requested_pages(out: Path) -> dict[int, dict[str, set[int]]]:
    """Per rank, per file name: the pages its request names."""
    result: dict[int, dict[str, set[int]]] = {}
    for path in sorted(out.glob("rank-*.json")):
        record = json.loads(path.read_text())
        assert record["exact"], record["reason"]
        result[record["rank"]] = pages_by_file(tuple(s[1:]) for s in record["spans"])
    return result


def touched_pages(trace: Path, out: Path) -> dict[int, dict[str, set[int]]]:
    """Per rank (its process, as the load script recorded it), per file: the pages its
    process read from the mount."""
    ranks = {}
    for path in out.glob("proc-*.json"):
        record = json.loads(path.read_text())
        ranks[record["pid"]] = record["rank"]
    result: dict[int, dict[str, set[int]]] = {rank: {} for rank in ranks.values()}
    for line in trace.read_text().splitlines():
        served = json.loads(line)
        rank = ranks.get(served["pid"])
        if rank is not None and served["file"].endswith(".safetensors"):
            first, size = served["offset"], served["size"]
            result[rank].setdefault(served["file"], set()).update(
                range(first // PAGE, (first + size - 1) // PAGE + 1)
            )
    return result


def without_headers(pages: dict[str, set[int]], model: Path) -> dict[str, set[int]]:
    """Tensor pages only: safe_open reads each header (and the page it ends in) itself."""
    result = {}
    for name, file_pages in pages.items():
        data_start = read_header(model / name).data_start
        kept = {p for p in file_pages if p * PAGE >= data_start}
        if kept:
            result[name] = kept
    return result


def assert_exact(out: Path, trace: Path, model: Path, ranks: int) -> None:
    requested = requested_pages(out)
    touched = touched_pages(trace, out)
    assert sorted(requested) == sorted(touched) == list(range(ranks))
    for rank in range(ranks):
        want = without_headers(touched[rank], model)
        got = without_headers(requested[rank], model)
        assert want, f"rank {rank} read no tensor page from the mount"
        missing = {f: sorted(want[f] - got.get(f, set())) for f in want}
        extra = {f: sorted(got[f] - want.get(f, set())) for f in got}
        assert not any(missing.values()), f"rank {rank} read pages it did not ask for: {missing}"
        assert not any(extra.values()), f"rank {rank} asked for pages it did not read: {extra}"


def assert_read_warm(trace: Path, out: Path, model: Path, ranks: int) -> None:
    read_by_ranks = touched_pages(trace, out)
    assert sorted(read_by_ranks) == list(range(ranks))
    for rank, pages in read_by_ranks.items():
        assert without_headers(pages, model) == {}, f"rank {rank} read cold: {pages}"


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
    log = load(model, tmp_path / "off", SPANWARM_SGLANG="<unset>")
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
