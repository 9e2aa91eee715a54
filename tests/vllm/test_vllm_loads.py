"""Real vLLM servers (``vllm.LLM`` on CPU, TP2 / EP) loading through the spanwarm plugin.

What each rank really reads is recorded independently of spanwarm: the checkpoint is
served by a FUSE mount (``spanwarm.testing.slowfs``) with the kernel's read-ahead off, so every page
a rank's weight loaders fault in is one read request of that rank's process, in the
mount's trace. The plugin's request of each rank (``SPANWARM_VLLM_SPANS_DIR``) must name
exactly those pages: coverage 100%, over-fetch 1.00. With a real daemon, the ranks then
read nothing from storage themselves, and generate the same tokens.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from spanwarm.checkpoint.safetensors_header import read_header
from spanwarm.integrations.vllm.whatif import Layout, deployment_spans
from spanwarm.pagecache.residency import PAGE
from tests import server_loads
from tests.daemon_harness import running_daemon
from tests.server_loads import assert_read_warm, pages_read, requested_pages, run_with_plugin
from tests.vllm.tiny_vllm_models import write_dense, write_fp8, write_moe

pytestmark = pytest.mark.timeout(900)

SERVE = Path(__file__).parents[2] / "bench" / "vllm_serve.py"
SERIAL_PLUGIN = Path(__file__).with_name("serial_plugin")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")
_RANK_LINE = re.compile(r"pid=(\d+)\).*spanwarm: rank (\d+) reads")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    dense = write_dense(root / "dense")
    return {"dense": dense, "moe": write_moe(root / "moe"), "fp8": write_fp8(root / "fp8", dense)}


def serve(
    model: Path, spans_dir: Path, *args: str, serial: bool = False, **env: str
) -> tuple[dict[str, Any], str]:
    """Run bench/vllm_serve.py; returns its JSON line (or {} where it died after loading) and
    its log. ``serial``: the ranks load one after another, each from a cold page cache
    (serial_plugin/serial_loads.py), so that each rank's reads are all its own."""
    spans_dir.mkdir(exist_ok=True)
    paths: list[Path] = []
    if serial:
        (spans_dir / "serial").mkdir()
        paths.append(SERIAL_PLUGIN)
        env = {"SPANWARM_TEST_SERIAL_DIR": str(spans_dir / "serial"), **env}
    done, log = run_with_plugin(
        "SPANWARM_VLLM",
        [sys.executable, str(SERVE), str(model), *args],
        spans_dir,
        paths=paths,
        timeout=800,
        env=env,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith('{"tokens"')]
    return (json.loads(lines[-1]) if lines else {}), log


def touched_pages(trace: Path, log: str) -> dict[int, dict[str, set[int]]]:
    """Per rank (its process, from the plugin's log line), per file: the pages it read."""
    return pages_read(trace, {int(pid): int(rank) for pid, rank in _RANK_LINE.findall(log)})


def recorded_spans(spans_dir: Path) -> dict[int, list[list[Any]]]:
    """Each rank's request as the plugin wrote it, file paths by name."""
    out = {}
    for path in spans_dir.glob("rank-*.json"):
        record = json.loads(path.read_text())
        out[record["rank"]] = [[t, os.path.basename(f), *rest] for t, f, *rest in record["spans"]]
    return out


def what_if(model: Path, layout: Layout) -> dict[int, list[list[Any]]]:
    """What ``spanwarm plan --vllm`` finds each rank of ``layout`` reads, with no server
    (file paths by name: the server read the mount, the what-if the source)."""
    per_rank = deployment_spans(str(model), layout, list(range(layout.world)))
    return {
        rank: [
            [s.tensor, os.path.basename(s.path), s.offset, s.length, s.stride, s.count]
            for s in spans
        ]
        for rank, spans in per_rank.items()
    }


def assert_exact(spans_dir: Path, trace: Path, log: str, model: Path, ranks: int) -> None:
    requested, touched = requested_pages(spans_dir), touched_pages(trace, log)
    server_loads.assert_exact(requested, touched, model, ranks, log)


def test_tp2_dense_requests_exactly_what_each_rank_reads_and_loads_it_warm(
    models: dict[str, Path], traced: Any, tmp_path: Path
) -> None:
    model = models["dense"]
    # Cold, the plugin only telling what it would ask for (SPANWARM_DISABLE), the ranks
    # loading one after another.
    mounted, trace = traced(model)
    cold, log = serve(mounted, tmp_path / "cold", "--tp", "2", serial=True, SPANWARM_DISABLE="1")
    assert cold.get("tokens"), log[-3000:]
    assert_exact(tmp_path / "cold", trace, log, model, ranks=2)
    # Every rank's view of its reads differs (TP2 splits; replicated norms are in both).
    requested = requested_pages(tmp_path / "cold")
    assert requested[0] != requested[1]
    # The what-if, with no server: the same requests.
    assert what_if(model, Layout(tp=2)) == recorded_spans(tmp_path / "cold")

    # Warm, with a real daemon: the ranks fault in nothing themselves.
    mounted, trace = traced(model)
    with running_daemon() as daemon:
        warm, log = serve(
            mounted,
            tmp_path / "warm",
            "--tp",
            "2",
            SPANWARM_SOCKET=daemon.socket,
            SPANWARM_VLLM_READ_YOURSELF="0",
        )
    assert warm.get("tokens") == cold["tokens"], log[-3000:]
    assert requested_pages(tmp_path / "warm") == requested
    # The request went out before the worker built its model: the daemon warms meanwhile.
    assert log.index("spanwarm: rank 0 reads") < log.index("Initializing model took"), log
    assert_read_warm(touched_pages(trace, log), model, ranks=2, log=log)


def test_fp8_tp2_requests_exactly_what_each_rank_reads(
    models: dict[str, Path], traced: Any, tmp_path: Path
) -> None:
    """An FP8 checkpoint (E4M3 weights, a per-tensor F32 scale each) as the default loader
    reads it: each rank's slices of the weights, and every scale, from the dry run.
    vLLM 0.32's CPU build has no FP8 kernels: its post-processing of the loaded weights is
    skipped, and the server only starts (no generation)."""
    model = models["fp8"]
    mounted, trace = traced(model)
    started, log = serve(
        mounted,
        tmp_path / "cold",
        "--tp",
        "2",
        "--no-generate",
        serial=True,
        SPANWARM_DISABLE="1",
        SPANWARM_TEST_NO_POSTPROCESS="1",
    )
    assert "start_s" in started, log[-3000:]
    assert_exact(tmp_path / "cold", trace, log, model, ranks=2)
    for rank in (0, 1):
        record = json.loads((tmp_path / "cold" / f"rank-{rank}.json").read_text())
        assert record["exact"], record.get("reason")
        assert any(t.endswith("weight_scale") for t, *_ in record["spans"])


@pytest.mark.parametrize("ep_filter", [False, True], ids=["ep", "ep-filter"])
def test_moe_tp2_ep_requests_only_local_experts(
    models: dict[str, Path], traced: Any, tmp_path: Path, ep_filter: bool
) -> None:
    """FusedMoE returns before touching a non-local expert; the EP filter skips handing
    it out. Generation on CPU crashes under EP in vLLM 0.32, after every weight loaded."""
    model = models["moe"]
    mounted, trace = traced(model)
    flags = ["--tp", "2", "--ep", "--no-generate", *(["--ep-filter"] if ep_filter else [])]
    _, log = serve(mounted, tmp_path / "cold", *flags, serial=True, SPANWARM_DISABLE="1")
    assert_exact(tmp_path / "cold", trace, log, model, ranks=2)
    layout = Layout(tp=2, ep=True, ep_filter=ep_filter)
    assert what_if(model, layout) == recorded_spans(tmp_path / "cold")
    for rank, local in ((0, {0, 1, 2, 3}), (1, {4, 5, 6, 7})):
        record = json.loads((tmp_path / "cold" / f"rank-{rank}.json").read_text())
        asked: dict[str, int] = {}
        for tensor, _, _, length, _, count in record["spans"]:
            asked[tensor] = asked.get(tensor, 0) + length * count
        # A local expert's tensors whole (16 KiB); of the others, at most the first page
        # get_tensor touches, and only where the filter hands them out.
        read = {int(m.group(1)) for t, n in asked.items() if (m := _EXPERT.search(t)) and n > PAGE}
        assert read == local
        handed = {int(m.group(1)) for t in record["handed_out"] if (m := _EXPERT.search(t))}
        assert handed == (local if ep_filter else set(range(8)))


def test_without_a_working_daemon_the_server_loads_as_without_spanwarm(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """No daemon (and a dry run with no time: whole tensors), a load strategy spanwarm
    does not warm, or a frozen daemon: the same tokens as with the plugin off."""
    model = models["dense"]
    plain, log = serve(model, tmp_path / "off", SPANWARM_VLLM="0")
    assert plain.get("tokens"), log[-3000:]
    assert "spanwarm: " not in log  # the plugin installed nothing

    absent, log = serve(
        model,
        tmp_path / "absent",
        SPANWARM_SOCKET=str(tmp_path / "no-daemon.sock"),
        SPANWARM_VLLM_DRY_RUN_S="0",
    )
    assert absent.get("tokens") == plain["tokens"], log[-3000:]
    assert "warming the tensors it is handed, whole" in log
    record = json.loads((tmp_path / "absent" / "rank-0.json").read_text())
    assert not record["exact"]
    assert "time budget" in record["reason"]
    assert {s[0] for s in record["spans"]} == set(record["handed_out"])

    # A strategy that reads whole files itself: one line says spanwarm warms nothing.
    eager, log = serve(model, tmp_path / "eager", "--load-strategy", "eager")
    assert eager.get("tokens") == plain["tokens"], log[-3000:]
    assert "spanwarm: safetensors load strategy 'eager' reads whole files itself" in log
    assert not list((tmp_path / "eager").glob("rank-*.json"))  # no dry run, no request

    with running_daemon() as daemon:
        daemon.process.send_signal(signal.SIGSTOP)
        try:
            frozen, log = serve(model, tmp_path / "frozen", SPANWARM_SOCKET=daemon.socket)
        finally:
            daemon.process.send_signal(signal.SIGCONT)
    assert frozen.get("tokens") == plain["tokens"], log[-3000:]


def test_pp2_each_stage_requests_exactly_its_layers(
    models: dict[str, Path], traced: Any, tmp_path: Path
) -> None:
    """Pipeline parallel: each stage reads only its own layers (vLLM 0.32 on CPU asserts
    in PP generation, after every weight loaded). The what-if tells the same."""
    model = models["dense"]
    mounted, trace = traced(model)
    flags = ["--pp", "2", "--no-generate"]
    _, log = serve(mounted, tmp_path / "cold", *flags, serial=True, SPANWARM_DISABLE="1")
    assert_exact(tmp_path / "cold", trace, log, model, ranks=2)
    layers = {
        rank: {
            int(m.group(1))
            for s in json.loads((tmp_path / "cold" / f"rank-{rank}.json").read_text())["spans"]
            if (m := re.search(r"\.layers\.(\d+)\.", s[0])) and s[3] * s[5] > PAGE
        }
        for rank in (0, 1)
    }
    assert layers == {0: {0, 1}, 1: {2, 3}}
    assert what_if(model, Layout(pp=2)) == recorded_spans(tmp_path / "cold")


def test_spanwarm_plan_vllm_prints_each_nodes_plan(models: dict[str, Path]) -> None:
    """``spanwarm plan --vllm``: node 1 of TP2 over two nodes of one rank each needs
    what rank 1's dry run names, and each file's header."""
    model = models["dense"]
    done = subprocess.run(
        [
            *(sys.executable, "-m", "spanwarm", "plan", str(model), "--vllm", "--tp", "2"),
            *("--local-world", "1", "--node", "1", "--json"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    plan = json.loads(done.stdout)
    assert plan["node"] == 1
    assert plan["ranks"] == [1]
    spans = deployment_spans(str(model), Layout(tp=2), [1])[1]
    intervals: dict[str, list[tuple[int, int]]] = {}
    for s in spans:
        for row in range(s.count):
            start = s.offset + row * s.stride
            intervals.setdefault(s.path, []).append((start, start + s.length))
    needed = 0  # the planner counts each file's header as needed: the loader reads it
    for path, rows in intervals.items():
        end = read_header(path).data_start
        needed += end
        for start, stop in sorted(rows):
            needed += max(0, stop - max(start, end))
            end = max(end, stop)
    assert plan["needed_bytes"] == needed
    assert 0 < needed < sum(f["size_bytes"] for f in plan["files"])
