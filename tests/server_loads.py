"""What the inference servers' suites (tests/vllm, tests/sglang) share: a checkpoint served
by a FUSE mount that traces each read, a load run with the server's plugin switched on,
and the checks that each rank's request names exactly the pages it read.

What each rank really reads is recorded independently of spanwarm: the mount
(``spanwarm.testing.slowfs``) has the kernel's read-ahead off, so every page a rank's weight loaders
fault in is one read request of that rank's process, in the mount's trace. The plugin
writes each rank's request to ``<spans dir>/rank-<R>.json``.

Each suite's conftest.py names :func:`traced` in its ``__all__``, so its tests get the
fixture.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from bench.span_pages import pages_by_file
from spanwarm.checkpoint.safetensors_header import read_header
from spanwarm.pagecache.residency import PAGE

__all__ = [
    "UNSET",
    "assert_exact",
    "assert_read_warm",
    "pages_read",
    "requested_pages",
    "run_with_plugin",
    "traced",
    "without_headers",
]

REPO = Path(__file__).parents[1]
UNSET = "<unset>"
"""An environment value for :func:`run_with_plugin`: the variable is not set."""

Pages = dict[int, dict[str, set[int]]]
"""Per rank, per file: page numbers."""


@pytest.fixture
def traced(tmp_path: Path) -> Iterator[Any]:
    """Mount a model on FUSE with read-ahead off: ``traced(model) -> (mount, trace)``."""
    from spanwarm.testing.slowfs import fuse_available, mount

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


def run_with_plugin(
    switch: str,
    command: Sequence[str],
    spans_dir: Path,
    *,
    paths: Sequence[Path] = (),
    timeout: float,
    env: dict[str, str],
) -> tuple[subprocess.CompletedProcess[str], str]:
    """Run ``command`` with the server's plugin switched on (``switch=1``) and writing each
    rank's request to ``spans_dir`` (``<switch>_SPANS_DIR``), the repository and ``paths``
    importable, ``env`` on top (:data:`UNSET`: not set); returns it and its log."""
    environ = {
        **os.environ,
        switch: "1",
        f"{switch}_SPANS_DIR": str(spans_dir),
        "PYTHONPATH": os.pathsep.join([str(REPO), *map(str, paths)]),
        **env,
    }
    done = subprocess.run(
        list(command),
        env={k: v for k, v in environ.items() if v != UNSET},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    return done, done.stdout + done.stderr


def requested_pages(spans_dir: Path) -> Pages:
    """Per rank, per file name: the pages its request names."""
    out: Pages = {}
    for path in sorted(spans_dir.glob("rank-*.json")):
        record = json.loads(path.read_text())
        assert record["exact"], record["reason"]
        out[record["rank"]] = pages_by_file(tuple(s[1:]) for s in record["spans"])
    return out


def pages_read(trace: Path, ranks: dict[int, int]) -> Pages:
    """Per rank (``ranks``: each rank's process id to its rank), per file: the pages its
    process read from the mount."""
    out: Pages = {rank: {} for rank in ranks.values()}
    for line in trace.read_text().splitlines():
        served = json.loads(line)
        rank = ranks.get(served["pid"])
        if rank is not None and served["file"].endswith(".safetensors"):
            first, size = served["offset"], served["size"]
            out[rank].setdefault(served["file"], set()).update(
                range(first // PAGE, (first + size - 1) // PAGE + 1)
            )
    return out


def without_headers(pages: dict[str, set[int]], model: Path) -> dict[str, set[int]]:
    """Tensor pages only: safe_open reads each header (and the page it ends in) itself."""
    out = {}
    for name, file_pages in pages.items():
        data_start = read_header(model / name).data_start
        kept = {p for p in file_pages if p * PAGE >= data_start}
        if kept:
            out[name] = kept
    return out


def assert_exact(requested: Pages, touched: Pages, model: Path, ranks: int, log: str = "") -> None:
    """Each of ``ranks`` ranks read tensor pages, and exactly those its request names."""
    assert sorted(requested) == sorted(touched) == list(range(ranks)), log[-3000:]
    for rank in range(ranks):
        want = without_headers(touched[rank], model)
        got = without_headers(requested[rank], model)
        assert want, f"rank {rank} read no tensor page from the mount"
        missing = {f: sorted(want[f] - got.get(f, set())) for f in want}
        extra = {f: sorted(got[f] - want.get(f, set())) for f in got}
        assert not any(missing.values()), f"rank {rank} read pages it did not ask for: {missing}"
        assert not any(extra.values()), f"rank {rank} asked for pages it did not read: {extra}"


def assert_read_warm(touched: Pages, model: Path, ranks: int, log: str = "") -> None:
    """Each of ``ranks`` ranks read no tensor page from the mount itself."""
    assert sorted(touched) == list(range(ranks)), log[-3000:]
    for rank, pages in touched.items():
        assert without_headers(pages, model) == {}, f"rank {rank} read cold: {pages}"
