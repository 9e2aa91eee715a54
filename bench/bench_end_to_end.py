"""End to end, the seed's scenario scaled to this machine.

    .venv/bin/python bench/bench_end_to_end.py [--mounts local,cross-region] [--reps 3] \
        [--arms none,whole,spanwarm,limit,cattensors,runai,fastsafetensors,instanttensor] \
        [--memory-limit 0.5]

A synthetic MoE + dense checkpoint (packed experts, or one tensor per expert) in 10
shards; a job of 4 nodes x 2 local ranks, whose 2 local ranks (node 0, or ``--node N``)
run here as processes with meta DTensors: TP x FSDP (2x4 mesh) for attention and
embeddings, EP over 8 ranks for the experts. Each rank loads its own slices through
safetensors. Arms, one after another on a freshly evicted page cache, interleaved per
repetition:

- (a) ``none``: no prefetch;
- (b) ``whole``: the seed's base PR, ``files[local_rank::local_world]`` read fully, then load;
- (c) ``spanwarm``: the daemon warms the node's spans; ranks wait per tensor;
- (d) ``limit``: what the storage allows for exactly the bytes spanwarm reads: the node
  plan's runs (the local ranks' spans through the cost model at the seek cost the daemon
  plans with on the mount) read by the best raw reader of the same mount, with no daemon
  and no loader: as many streams as the daemon has workers, a fresh descriptor per
  operation, operations of the daemon's chunk size, read with read-ahead doubled
  (``FADV_SEQUENTIAL``) where the device's window is smaller than an operation, as the
  daemon streams such a piece, else exactly (``FADV_RANDOM``);
- the loaders users pick instead (the ``bench-peers`` extra; bench/peer_loaders.py says how
  each is used): ``cattensors``, ``runai`` (runai-model-streamer), ``fastsafetensors``,
  ``instanttensor``. An arm whose package is not installed, or that cannot run here (a
  tiny load through it, before the runs, fails), stays in the table with the reason.

``--arms`` picks the arms (default: the first four).

``--memory-limit FRACTION``: the node has less memory than it must read. The node's ranks,
the daemon and the limit arm's reader run in one memory cgroup (bench/memory_cgroup.py:
cgroup v1's ``memory.limit_in_bytes``, else v2's ``memory.max``; skipped with the reason
where neither can be set) whose room for page cache is FRACTION of the node plan's bytes:
its limit is that plus what the node's processes hold themselves (the ranks' and the
daemon's anonymous memory, measured in the unlimited first load). Ranks copy each slice
into one reused buffer (``--discard``: on a GPU node the weights are device memory, not the
node's), so the cgroup holds page cache and the processes, not weights. The daemon is
started inside the cgroup after its limit is set (its budget comes from the cgroup's room;
the bench checks that its pid is there and reports the budget), sharing the state
directory of the unlimited daemon that learned the mount. Peers' buffers get each rank's
share of the cache room (``RUNAI_STREAMER_MEMORY_LIMIT``, fastsafetensors'
``device_memory_budget``), or the largest tensor where that is larger. The resident pairs
are skipped.

Before the measured runs, one ``spanwarm`` load (not measured) is the node's first on the
mount: the daemon learns the mount's throughput from it and, once idle, probes its seek
cost, as on a node whose first job has loaded (a probe would otherwise run during the
next arm). The bench waits for that figure and plans ``limit`` with it.

Reported per arm: wall time until both local ranks have loaded (for ``limit``: until the
last run is read), time to each rank's first tensor, bytes read from storage (the emulated
mount's counter; on ``local`` the block device's read counter, which anything else reading
meanwhile adds to), and peak page cache used by the checkpoint (sampled with mincore); for
``spanwarm`` also its warm phase (request to the last requested tensor ready, slowest
rank). Bytes read from storage include re-reads after eviction; *more than once* says
whether an arm read more than 1.05x its footprint, the bytes it needs once: the node plan
for ``none``, ``spanwarm`` and ``limit``, every file for ``whole`` and ``cattensors``
(whole-file warming), the node's tensors, whole, for the other peers (for ``none``,
read-ahead past its slices counts too); under a memory limit also the cgroup's peak
usage. Then, with every byte already resident, paired ``none`` and ``spanwarm`` runs
(``--warm-reps``): what spanwarm costs when there is nothing to gain; ranks copy into new
tensors they keep, or, with ``--resident-load in-place``, into memory of their own
allocated and zeroed before the barrier (as torch DCP loads in place: no page faults on
the destination, so the load is shortest and spanwarm's request the largest share of it).
``--json PATH`` writes each mount and layout's median walls and paired ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import peer_loaders
from bench.memory_cgroup import MemoryCgroup, anonymous_memory, create_memory_cgroup
from spanwarm.checkpoint.resolve import Checkpoint, open_checkpoint
from spanwarm.checkpoint.samples import write_sharded_checkpoint
from spanwarm.checkpoint.tensor_layout import TensorSpans
from spanwarm.client import Client
from spanwarm.daemon.throughput import mount_name
from spanwarm.pagecache.read_ahead import hint_window
from spanwarm.pagecache.residency import PAGE, cached_pages, evict, file_residency
from spanwarm.pagecache.warm_engine import WarmEngine, WarmMethod
from spanwarm.planning.costmodel import DEFAULT_SEEK_COST
from spanwarm.planning.planner import plan_node_spans
from spanwarm.testing.spawn import spawn_daemon
from spanwarm.units import format_bytes, parse_size

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
HIDDEN, LAYERS, EXPERTS, MOE_INTERMEDIATE, VOCAB = 2048, 8, 32, 768, 32000
WORLD, LOCAL_WORLD = 8, 2
BASE_ARMS = ("none", "whole", "spanwarm", "limit")
ARMS = (*BASE_ARMS, *peer_loaders.PEERS)
# What each arm needs to read once (its footprint): the node plan, whole files, or the
# node's tensors whole; more than MORE_THAN_ONCE x that counts as reading bytes twice.
WHOLE_FILES, WHOLE_TENSORS = ("whole", "cattensors"), peer_loaders.STREAMED
MORE_THAN_ONCE = 1.05  # on local, other readers of the disk add to its counter
# Under --memory-limit: room in the cgroup beyond the processes' measured memory and the
# page cache share (the kernel's own charges, a rank's allocations after its first load).
CGROUP_SLACK = 64 * 2**20
WORKERS, CHUNK = 8, 8 * 2**20  # the daemon's defaults: operations in flight, their size
# Every rank process, every arm: OMP_NUM_THREADS=1, as torchrun sets it for more than one
# local rank: torch's threads of two ranks on two cores otherwise spin against each
# other, which made resident loads' CPU 0.35-0.7 s a rank where one rank alone takes
# 0.12 s, and every arm's walls swing twofold.
RANK_ENV = {"OMP_NUM_THREADS": "1"}


def build_checkpoint(directory: Path, layout: str) -> list[Path]:
    """Write (once) the MoE checkpoint with random bytes; reuse it when it is there."""
    marker = directory / "complete"
    if marker.exists():
        return sorted(directory.glob("*.safetensors"))
    shutil.rmtree(directory, ignore_errors=True)
    rng = np.random.default_rng(0)

    def tensor(*shape: int) -> tuple[str, tuple[int, ...], bytes]:
        return (
            "BF16",
            shape,
            rng.integers(0, 256, int(np.prod(shape)) * 2, dtype=np.uint8).tobytes(),
        )

    tensors: dict[str, Any] = {"model.embed_tokens.weight": tensor(VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        tensors[f"{p}.input_layernorm.weight"] = tensor(HIDDEN)
        tensors[f"{p}.self_attn.q_proj.weight"] = tensor(HIDDEN, HIDDEN)
        tensors[f"{p}.self_attn.k_proj.weight"] = tensor(HIDDEN // 4, HIDDEN)
        tensors[f"{p}.self_attn.v_proj.weight"] = tensor(HIDDEN // 4, HIDDEN)
        tensors[f"{p}.self_attn.o_proj.weight"] = tensor(HIDDEN, HIDDEN)
        tensors[f"{p}.post_attention_layernorm.weight"] = tensor(HIDDEN)
        tensors[f"{p}.mlp.gate.weight"] = tensor(EXPERTS, HIDDEN)
        if layout == "packed":
            tensors[f"{p}.mlp.experts.gate_up_proj"] = tensor(EXPERTS, 2 * MOE_INTERMEDIATE, HIDDEN)
            tensors[f"{p}.mlp.experts.down_proj"] = tensor(EXPERTS, HIDDEN, MOE_INTERMEDIATE)
        else:
            for e in range(EXPERTS):
                for proj, shape in (
                    ("gate_proj", (MOE_INTERMEDIATE, HIDDEN)),
                    ("up_proj", (MOE_INTERMEDIATE, HIDDEN)),
                    ("down_proj", (HIDDEN, MOE_INTERMEDIATE)),
                ):
                    tensors[f"{p}.mlp.experts.{e}.{proj}.weight"] = tensor(*shape)
    tensors["model.norm.weight"] = tensor(HIDDEN)
    tensors["lm_head.weight"] = tensor(VOCAB, HIDDEN)
    total = sum(len(t[2]) for t in tensors.values())
    paths = write_sharded_checkpoint(directory, tensors, shard_bytes=total // 10 + 1)
    settle(paths)
    marker.touch()
    return paths


def settle(paths: list[Path]) -> None:
    """Sync freshly written files and read them back once: the first read of fresh data
    is slower on this VM (host cache, write-back), which would penalise whichever arm
    happens to run first."""
    for path in paths:
        with open(path, "rb") as f:
            os.fsync(f.fileno())
            while f.read(64 * 2**20):
                pass


def cached_bytes(path: Path) -> int:
    """Bytes of ``path`` in the page cache, pages being read in included (cachestat: 5 ns a
    page here, against mincore's 60, which on two cores would take a tenth of one from the
    ranks while sampling the whole checkpoint every 100 ms)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        pages = cached_pages(fd, 0, size) if size else 0
    finally:
        os.close(fd)
    return file_residency(path)[0] if pages is None else min(pages * PAGE, size)


class CacheSampler:
    """Peak page cache held by the checkpoint files during a run (cachestat every 100 ms),
    and the node plan the daemon held (its Status, every 250 ms until two answers agree:
    the local ranks' requests go out together, so the plan is whole within the first
    quarter second; a Status during a load costs the daemon a few ms of CPU, which on a
    2-core machine the spanwarm arm would pay and the others not)."""

    def __init__(self, paths: list[Path], socket: str | None) -> None:
        self.paths = paths
        self.peak = 0
        self.planned = 0
        self._socket = socket
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._sample_cache, daemon=True)]
        if socket is not None:
            self._threads.append(threading.Thread(target=self._sample_plan, daemon=True))

    def _sample_cache(self) -> None:
        while not self._stop.wait(0.1):
            self.peak = max(self.peak, self.resident())

    def _sample_plan(self) -> None:
        client = Client(self._socket)
        while not self._stop.wait(0.25):
            planned = client.status()["bytes_planned"]
            if planned and planned == self.planned:
                break
            self.planned = max(self.planned, planned)
        client.close()

    def resident(self) -> int:
        return sum(cached_bytes(p) for p in self.paths)

    def __enter__(self) -> CacheSampler:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()
        self.peak = max(self.peak, self.resident())


@contextlib.contextmanager
def mounted(source: Path, preset: str) -> Iterator[tuple[Path, Any]]:
    """The checkpoint as ranks see it: the directory itself, or an emulated mount of it."""
    if preset == "local":
        yield source, None
        return
    from spanwarm.testing.slowfs import fuse_available, mount

    reason = fuse_available()
    if reason is not None:
        raise SystemExit(f"{preset}: skipped, FUSE is not available here ({reason})")
    with (
        tempfile.TemporaryDirectory(prefix="sw-mnt-") as mountpoint,
        mount(source, Path(mountpoint), preset) as fs,
    ):
        yield Path(mountpoint), fs


def device_bytes_read(path: Path) -> int:
    """Bytes the block device under ``path`` has read since boot (/sys/dev/block/*/stat)."""
    st = os.stat(path)
    fields = (
        Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/stat").read_text().split()
    )
    return int(fields[2]) * 512


def storage_bytes(paths: list[Path], fs: Any) -> int:
    """The emulated mount's counter, or the local block device's."""
    return int(fs.stats()["bytes"]) if fs is not None else device_bytes_read(paths[0])


def run_local_ranks(
    script: str,
    arm: str,
    checkpoint: Path,
    paths: list[Path],
    socket: str,
    fs: Any,
    *,
    world: int,
    local_world: int,
    extra: tuple[str, ...] = (),
    stderr: int | None = None,
    cold: bool = True,
    first_rank: int = 0,
    cgroup: MemoryCgroup | None = None,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """One arm on a node (its ranks from ``first_rank`` on): evict, run ``script`` as its
    ``local_world`` ranks started together at a file barrier, and measure. Each rank prints
    a JSON line ending with ``start`` and ``total_s``; those lines come back as
    ``results``, with the wall time from the first start to the last finish, bytes read
    from storage, peak page cache and node plan (not sampled unless ``cold``: with every
    byte resident there is nothing to see, and the sampling's CPU, the daemon's Status
    calls under spanwarm, would be in the walls). With ``cgroup``, the ranks run in it
    (and its peak usage and OOM kills are reported); ``env`` adds to their environment.
    A rank that fails raises RuntimeError with the end of its stderr (kept unless
    ``stderr`` sends it elsewhere)."""
    for path in paths if cold else ():
        evict(path)
    barrier = Path(tempfile.mkdtemp(prefix="sw-barrier-"))
    before = storage_bytes(paths, fs)
    kills = cgroup.oom_kills() if cgroup is not None else 0
    if cgroup is not None:
        cgroup.reset_peak()
    sampling = CacheSampler(paths, socket if arm == "spanwarm" else None)
    # Each rank's stderr in a file (a pipe read after its stdout could fill and stall it);
    # closed in the finally below.
    logs = [tempfile.TemporaryFile() for _ in range(local_world)]  # noqa: SIM115
    try:
        with sampling if cold else contextlib.nullcontext(sampling) as sampler:
            ranks = []
            for r in range(local_world):
                command = [
                    sys.executable,
                    str(HERE / script),
                    str(checkpoint),
                    *("--arm", arm, "--rank", str(first_rank + r), "--local-rank", str(r)),
                    *("--local-world", str(local_world), "--world", str(world)),
                    *("--barrier", str(barrier), "--socket", socket, *extra),
                ]
                ranks.append(
                    subprocess.Popen(
                        command if cgroup is None else cgroup.join_command(command),
                        stdout=subprocess.PIPE,
                        stderr=logs[r] if stderr is None else stderr,
                        cwd=ROOT,
                        env={**RANK_ENV, **os.environ, **(env or {})},
                    )
                )
            outputs = [p.communicate()[0] for p in ranks]
        if any(p.returncode for p in ranks):
            raise RuntimeError(rank_failure(arm, ranks, logs, cgroup, kills))
        results = [json.loads(out.splitlines()[-1]) for out in outputs]
    finally:
        shutil.rmtree(barrier, ignore_errors=True)
        for log in logs:
            log.close()
    start = min(r["start"] for r in results)
    return {
        "arm": arm,
        "results": results,
        "wall_s": max(r["start"] + r["total_s"] for r in results) - start,
        "storage_bytes": storage_bytes(paths, fs) - before,
        "peak_cache_bytes": sampler.peak,
        "planned_bytes": sampler.planned,
        "cgroup_peak_bytes": cgroup.peak() if cgroup is not None else None,
        "oom_kills": cgroup.oom_kills() - kills if cgroup is not None else 0,
    }


def rank_failure(
    arm: str,
    ranks: list[subprocess.Popen[bytes]],
    logs: Sequence[IO[bytes]],
    cgroup: MemoryCgroup | None,
    kills: int,
) -> str:
    """Why a run's ranks failed: exit codes, OOM kills in the cgroup, the last line of the
    first failed rank's stderr."""
    codes = [p.returncode for p in ranks]
    reason = f"{arm}: a rank failed ({codes})"
    if cgroup is not None and cgroup.oom_kills() > kills:
        reason += f", {cgroup.oom_kills() - kills} OOM kill(s) in the memory cgroup"
    for p, log in zip(ranks, logs, strict=True):
        log.seek(0)
        lines = log.read().decode(errors="replace").strip().splitlines()
        if p.returncode and lines:
            sys.stderr.write("\n".join(lines[-20:]) + "\n")
            return f"{reason}: {lines[-1]}"
    return reason


def node_requests(checkpoint: Path, node: int = 0) -> tuple[list[TensorSpans], set[str]]:
    """The node's local ranks' spans, as the spanwarm arm requests them, and the names of
    the tensors they load (computed by e2e_rank.py)."""
    spans, names = [], set()
    for local in range(LOCAL_WORLD):
        rank = node * LOCAL_WORLD + local
        out = subprocess.run(
            [
                sys.executable,
                str(HERE / "e2e_rank.py"),
                str(checkpoint),
                *("--arm", "spans", "--rank", str(rank), "--local-rank", str(local)),
                *("--local-world", str(LOCAL_WORLD), "--world", str(WORLD)),
                *("--barrier", "-", "--experts", str(EXPERTS)),
            ],
            capture_output=True,
            text=True,
            check=True,
            cwd=ROOT,
        ).stdout
        spans += [TensorSpans("", *row) for row in json.loads(out.splitlines()[-1])]
        names.update(json.loads(out.splitlines()[-2]))
    return spans, names


def node_runs(checkpoint: Path, seek_cost: int, node: int = 0) -> list[tuple[str, int, int]]:
    """The node plan's runs, (path, start, stop): the local ranks' spans, computed by
    e2e_rank.py as the spanwarm arm requests them, through the cost model."""
    spans, _ = node_requests(checkpoint, node)
    return plan_runs(checkpoint, spans, seek_cost, node)


def plan_runs(
    checkpoint: Path, spans: list[TensorSpans], seek_cost: int, node: int
) -> list[tuple[str, int, int]]:
    """The runs of the node plan for the local ranks' ``spans``."""
    ranks = [node * LOCAL_WORLD + r for r in range(LOCAL_WORLD)]
    plan = plan_node_spans(
        open_checkpoint(checkpoint),
        spans,
        node=node,
        ranks=ranks,
        seek_cost=seek_cost,
    )
    return [(f.path, a, b) for f in plan.files for a, b in f.runs.pairs()]


def footprints(checkpoint: Path, plan_bytes: int, names: set[str]) -> dict[str, int]:
    """Per arm, the bytes it needs to read once: the node plan (what the ranks' slices
    touch, as spanwarm plans it), every file whole, or the node's tensors (``names``)
    whole."""
    files = open_checkpoint(checkpoint)
    whole_files = sum(header.file_size for header in files.headers)
    whole_tensors = sum(tensor_bytes(files, name) for name in names)
    return {
        arm: whole_files
        if arm in WHOLE_FILES
        else whole_tensors
        if arm in WHOLE_TENSORS
        else plan_bytes
        for arm in ARMS
    }


def tensor_bytes(checkpoint: Checkpoint, name: str) -> int:
    return sum(info.end - info.begin for _, info in checkpoint.pieces[name])


def read_runs(runs: list[tuple[str, int, int]]) -> None:
    """Read ``runs`` like the daemon: WORKERS streams, a fresh descriptor per operation of
    at most CHUNK bytes (cut at CHUNK boundaries), the read method. The descriptor is
    FADV_RANDOM where the device's read-ahead window covers an operation, else
    FADV_SEQUENTIAL, as the daemon's populate streams such a piece: twice the window a
    request (on FUSE 256 KiB, half the round trips through the file system's server;
    the daemon alone with them warmed the plan 5-15% sooner than this arm read it with
    FADV_RANDOM)."""
    engine = WarmEngine(WarmMethod.READ, chunk_bytes=CHUNK)
    operations = [
        (path, start, min(b, (start // CHUNK + 1) * CHUNK))
        for path, a, b in runs
        for start in [a, *range((a // CHUNK + 1) * CHUNK, b, CHUNK)]
    ]

    def operation(op: tuple[str, int, int]) -> None:
        fd = os.open(op[0], os.O_RDONLY | os.O_CLOEXEC)
        try:
            streamed = op[2] - op[1] > hint_window(os.fstat(fd).st_dev)
            advice = os.POSIX_FADV_SEQUENTIAL if streamed else os.POSIX_FADV_RANDOM
            os.posix_fadvise(fd, 0, 0, advice)
            engine.warm(fd, [(op[1], op[2])])
        finally:
            os.close(fd)

    with ThreadPoolExecutor(WORKERS) as pool:
        list(pool.map(operation, operations))


def run_limit(
    runs: list[tuple[str, int, int]],
    paths: list[Path],
    fs: Any,
    cgroup: MemoryCgroup | None = None,
) -> dict[str, Any]:
    """The limit arm; with ``cgroup``, the bench reads from inside it (the page cache it
    fills is charged there)."""
    for path in paths:
        evict(path)
    before = storage_bytes(paths, fs)
    if cgroup is not None:
        cgroup.reset_peak()
    with (
        CacheSampler(paths, None) as sampler,
        cgroup.joined() if cgroup is not None else contextlib.nullcontext(),
    ):
        start = time.monotonic()
        read_runs(runs)
        wall = time.monotonic() - start
    return {
        "arm": "limit",
        "wall_s": wall,
        "storage_bytes": storage_bytes(paths, fs) - before,
        "peak_cache_bytes": sampler.peak,
        "planned_bytes": sum(b - a for _, a, b in runs),
        "first_s": [wall] * LOCAL_WORLD,
        "request_s": [0.0] * LOCAL_WORLD,
        "warm_s": wall,
        "loaded_bytes": 0,
        "cgroup_peak_bytes": cgroup.peak() if cgroup is not None else None,
        "oom_kills": 0,
    }


def run_arm(
    arm: str,
    checkpoint: Path,
    paths: list[Path],
    socket: str,
    fs: Any,
    *,
    cold: bool = True,
    rank_args: tuple[str, ...] = (),
    node: int = 0,
    cgroup: MemoryCgroup | None = None,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    run = run_local_ranks(
        "e2e_rank.py",
        arm,
        checkpoint,
        paths,
        socket,
        fs,
        world=WORLD,
        local_world=LOCAL_WORLD,
        extra=("--experts", str(EXPERTS), *rank_args),
        cold=cold,
        first_rank=node * LOCAL_WORLD,
        cgroup=cgroup,
        env=env,
    )
    results = run.pop("results")
    warm = [r["warm_s"] for r in results if r.get("warm_s") is not None]
    return {
        **run,
        "first_s": [r["first_s"] for r in results],
        "request_s": [r["request_s"] for r in results],
        "warm_s": max(warm) if warm else None,
        "loaded_bytes": sum(r["bytes"] for r in results),
        "outcomes": [r.get("outcomes", {}) for r in results],
        "waited_s": [round(r.get("waited_s", 0.0), 3) for r in results],
        "anon_bytes": sum(r.get("anon_bytes", 0) for r in results),
    }


def probed_seek_cost(socket: str, path: Path, daemon_args: list[str]) -> int:
    """After the node's first load on ``path``'s mount: wait for the daemon's probe there
    (a first one, or one again where the figure kept is disturbed or old), and return the
    seek cost it plans with now (``--seek-cost``'s, when given)."""
    if "--seek-cost" in daemon_args:
        return parse_size(daemon_args[daemon_args.index("--seek-cost") + 1])
    mount = mount_name(os.stat(path).st_dev)
    client = Client(socket)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        known = {
            m["mount"]: m["seek_cost_bytes"]
            for m in client.status()["mounts"]
            if not m.get("seek_probe_due")
        }
        if known.get(mount):
            client.close()
            return int(known[mount])
        time.sleep(0.2)
    client.close()
    # None of the files the load named had cold places left: the daemon plans at the
    # default, and may probe during a later arm, on a file a later load names.
    print(f"  {mount}: not probed after the first load; seek cost stays the default")
    return DEFAULT_SEEK_COST


def touch_every_page(paths: list[Path]) -> None:
    """Read every byte of ``paths`` through the page cache, resident or not: reclaim (this
    VM's DAMON pageout takes idle page cache within seconds) must not leave one arm of a
    resident pair holes to read that the other did not. A read marks resident pages
    accessed again, which the warm engine (it skips what is resident) would not."""
    buffer = bytearray(CHUNK)
    for path in paths:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            while os.readv(fd, [buffer]) == CHUNK:
                pass
        finally:
            os.close(fd)


def warm_cache(
    reps: int,
    checkpoint: Path,
    paths: list[Path],
    socket: str,
    fs: Any,
    *,
    in_place: bool,
    node: int = 0,
) -> dict[str, float]:
    """none and spanwarm with every byte already resident (nothing evicted, every page read
    again right before each arm): what spanwarm costs when there is nothing to gain."""
    if reps < 1:
        return {}
    ratios, nones, spanwarms, requests = [], [], [], []
    for rep in range(reps):
        walls = {}
        for arm in ("none", "spanwarm") if rep % 2 == 0 else ("spanwarm", "none"):
            touch_every_page(paths)
            # Alternated: whichever runs second finds what the first left (its pages
            # touched again, the daemon's threads warm), and must not always be spanwarm.
            rank_args = ("--in-place",) if in_place else ()
            run = run_arm(
                arm, checkpoint, paths, socket, fs, cold=False, rank_args=rank_args, node=node
            )
            walls[arm] = run["wall_s"]
            if arm == "spanwarm":
                requests.append(max(run["request_s"]))
        none, spanwarm = walls["none"], walls["spanwarm"]
        nones.append(none)
        spanwarms.append(spanwarm)
        ratios.append(none / spanwarm)
    # Beside the paired median: each arm's fastest run. On a shared VM interference only
    # ever adds time (single pairs here range 0.2-3.6), so the fastest runs are the
    # closest either arm gets to its own work; the request's time is what spanwarm adds.
    return {
        "none_s": statistics.median(nones),
        "spanwarm_s": statistics.median(spanwarms),
        "none/spanwarm": statistics.median(ratios),
        "fastest none/spanwarm": min(nones) / min(spanwarms),
        "fastest_none_s": min(nones),
        "fastest_spanwarm_s": min(spanwarms),
        "request_s": statistics.median(requests),
    }


def peer_availability(arms: list[str]) -> dict[str, str]:
    """Per peer arm that cannot run here, why: its package is missing, or a tiny load
    through it failed (bench/peer_loaders.py's probe; the last line of its stderr)."""
    reasons = {}
    for arm in arms:
        if arm not in peer_loaders.PEERS:
            continue
        done = subprocess.run(
            [sys.executable, str(HERE / "peer_loaders.py"), arm],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env={**RANK_ENV, **os.environ},
        )
        lines = done.stderr.strip().splitlines()
        if done.returncode:
            reasons[arm] = lines[-1] if lines else f"its probe exited {done.returncode}"
            print(f"{arm}: does not install/run here: {reasons[arm]}", flush=True)
        else:
            print(f"{arm}: {done.stdout.strip()}", flush=True)
    return reasons


def parse_arms(text: str) -> list[str]:
    arms = [arm for arm in text.split(",") if arm]
    unknown = sorted(set(arms) - set(ARMS))
    if unknown or "spanwarm" not in arms:
        raise SystemExit(f"--arms: {unknown} unknown, or no spanwarm; choose among {ARMS}")
    return arms


def repetitions(
    arms: list[str],
    reps: int,
    rng: random.Random,
    label: str,
    limit_runs: list[tuple[str, int, int]],
    checkpoint: Path,
    paths: list[Path],
    socket: str,
    fs: Any,
    *,
    node: int,
    cgroup: MemoryCgroup | None = None,
    env: dict[str, str] | None = None,
    rank_args: tuple[str, ...] = (),
) -> list[dict[str, Any]]:
    """``reps`` repetitions of ``arms``, in a fresh random order each. A peer arm that
    fails, or any arm under a memory limit (an OOM kill is a result there), is recorded
    with its error; a base arm's failure elsewhere stops the bench."""
    runs = []
    for rep in range(reps):
        for arm in rng.sample(arms, len(arms)):
            try:
                if arm == "limit":
                    result = run_limit(limit_runs, paths, fs, cgroup)
                else:
                    result = run_arm(
                        arm,
                        checkpoint,
                        paths,
                        socket,
                        fs,
                        node=node,
                        cgroup=cgroup,
                        env=env,
                        rank_args=rank_args,
                    )
            except RuntimeError as error:
                if arm in BASE_ARMS and cgroup is None:
                    raise
                result = {"arm": arm, "error": str(error)}
            result["rep"] = rep
            runs.append(result)
            print_run(label, rep, result)
    return runs


def print_run(label: str, rep: int, result: dict[str, Any]) -> None:
    arm = result["arm"]
    if "error" in result:
        print(f"  {label} rep {rep} {arm}: failed: {result['error']}", flush=True)
        return
    print(
        f"  {label} rep {rep} {arm}: {result['wall_s']:.2f} s, "
        f"read {format_bytes(result['storage_bytes'])}, first tensor "
        f"{result['first_s']}, spans sent after {result['request_s']}"
        + (f", waits {result['outcomes']} for {result['waited_s']} s" if arm == "spanwarm" else "")
        + (
            f", cgroup peak {format_bytes(result['cgroup_peak_bytes'])}"
            if result.get("cgroup_peak_bytes") is not None
            else ""
        ),
        flush=True,
    )


def largest_tensor(checkpoint: Path) -> int:
    files = open_checkpoint(checkpoint)
    return max(tensor_bytes(files, name) for name in files.pieces)


def peer_memory_env(cache_room: int, largest: int) -> dict[str, str]:
    """Under a memory limit, each rank's share of the cache room for a peer's buffers (or
    the largest tensor, which their buffers must hold, where that is larger)."""
    share = str(max(cache_room // LOCAL_WORLD, largest))
    return {"RUNAI_STREAMER_MEMORY_LIMIT": share, peer_loaders.MEMORY_ENV: share}


@contextlib.contextmanager
def daemon_in(cgroup: MemoryCgroup, flags: list[str]) -> Iterator[Any]:
    """A daemon started inside ``cgroup`` (the bench joins it while it forks the daemon),
    checked to be there."""
    with contextlib.ExitStack() as stack:
        with cgroup.joined():
            daemon = stack.enter_context(spawn_daemon(*flags))
        if not cgroup.holds(daemon.process.pid):
            raise RuntimeError(f"the daemon ({daemon.process.pid}) is not in {cgroup.directory}")
        yield daemon


def daemon_budget(socket: str) -> int:
    client = Client(socket)
    try:
        return int(client.status()["budget_bytes"])
    finally:
        client.close()


def state_dir_flags(daemon_args: list[str], directory: str) -> list[str]:
    """``daemon_args`` with a state directory (``directory`` unless they name one): the
    daemon in the cgroup learns nothing again that the first daemon learned."""
    return daemon_args if "--state-dir" in daemon_args else [*daemon_args, "--state-dir", directory]


def paired(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median walls per arm and the paired median ratios (runs of one repetition)."""
    by_arm = {arm: ok for arm in ARMS if (ok := succeeded(runs, arm))}

    def ratio(a: str, b: str, key: str = "wall_s", key_b: str = "wall_s") -> float | None:
        pairs = [
            x[key] / y[key_b]
            for x in by_arm.get(a, [])
            for y in by_arm.get(b, [])
            if x["rep"] == y["rep"]
        ]
        return float(statistics.median(pairs)) if pairs else None

    ratios = {f"{arm}/spanwarm": ratio(arm, "spanwarm") for arm in by_arm if arm != "spanwarm"}
    ratios["spanwarm/limit"] = ratio("spanwarm", "limit")
    ratios["spanwarm_warm_phase/limit"] = ratio("spanwarm", "limit", "warm_s")
    return {
        "arms": {
            arm: {
                "wall_s": statistics.median(r["wall_s"] for r in rs),
                "storage_bytes": statistics.median(r["storage_bytes"] for r in rs),
            }
            for arm, rs in by_arm.items()
        },
        "paired": {name: value for name, value in ratios.items() if value is not None},
        "spanwarm_warm_phase_s": statistics.median(r["warm_s"] for r in by_arm.get("spanwarm", []))
        if "spanwarm" in by_arm
        else None,
    }


def succeeded(runs: list[dict[str, Any]], arm: str) -> list[dict[str, Any]]:
    return [r for r in runs if r["arm"] == arm and "error" not in r]


def arm_row(arm: str, rs: list[dict[str, Any]], footprint: int, plan: int) -> str:
    """One arm's row: wall, first tensor, storage (re-reads included) against the node plan
    and against the arm's own footprint, peak page cache, and the cgroup's peak."""
    walls = [r["wall_s"] for r in rs]
    firsts = [statistics.median(r["first_s"][i] for r in rs) for i in range(LOCAL_WORLD)]
    first = "" if arm == "limit" else " / ".join(f"{f * 1000:.0f} ms" for f in firsts)
    read = statistics.median(r["storage_bytes"] for r in rs)
    twice = "yes" if read > MORE_THAN_ONCE * footprint else "no"
    peak = statistics.median(r["peak_cache_bytes"] for r in rs)
    peaks = [r["cgroup_peak_bytes"] for r in rs if r.get("cgroup_peak_bytes") is not None]
    cgroup = f" | {format_bytes(int(statistics.median(peaks)))}" if peaks else ""
    return (
        f"| {arm} | {statistics.median(walls):.2f} s ({min(walls):.2f}-{max(walls):.2f}) | "
        + first
        + f" | {format_bytes(int(read))} ({read / plan:.2f}x) | "
        f"{twice} ({read / footprint:.2f}x) | {format_bytes(int(peak))}{cgroup} |"
    )


def summarize(
    label: str,
    runs: list[dict[str, Any]],
    arms: list[str],
    footprint: dict[str, int],
    unavailable: dict[str, str],
) -> list[str]:
    plan = footprint["spanwarm"]
    limited = any(r.get("cgroup_peak_bytes") is not None for r in runs)
    lines = [
        f"\n### {label}\n",
        "| arm | wall (median, min-max) | first tensor, rank 0 / 1 (median) "
        "| read from storage (x node plan) | more than once? (x its footprint) "
        "| peak page cache |" + (" cgroup peak |" if limited else ""),
        "| --- | --- | --- | --- | --- | --- |" + (" --- |" if limited else ""),
    ]
    empty = " |" * (4 + limited)
    for arm in arms:
        rs = succeeded(runs, arm)
        errors = [r["error"] for r in runs if r["arm"] == arm and "error" in r]
        if arm in unavailable:
            lines.append(f"| {arm} | does not install/run here: {unavailable[arm]} |{empty}")
        elif not rs:
            lines.append(f"| {arm} | failed in every run: {errors[0] if errors else '-'} |{empty}")
        else:
            lines.append(arm_row(arm, rs, footprint[arm], plan))
            if errors:
                lines[-1] += f" ({len(errors)} run(s) failed: {errors[0]})"
    figures = paired(runs)
    ratios = figures["paired"]
    versus = ", ".join(
        f"{name.split('/')[0]} {value:.2f}x"
        for name, value in ratios.items()
        if name.endswith("/spanwarm")
    )
    if versus:
        lines.append(f"\nPaired ratios (same repetition), median, arm / spanwarm: {versus}.")
    if "spanwarm/limit" in ratios:
        lines.append(
            f"Against the limit: spanwarm end to end {ratios['spanwarm/limit']:.2f}x, its warm "
            f"phase ({figures['spanwarm_warm_phase_s']:.2f} s, request to the last tensor "
            f"ready) {ratios['spanwarm_warm_phase/limit']:.2f}x."
        )
    spanwarm = succeeded(runs, "spanwarm")
    if spanwarm:
        read = statistics.median(r["storage_bytes"] for r in spanwarm)
        lines.append(
            f"spanwarm read {format_bytes(int(read))} from storage for a node plan of "
            f"{format_bytes(plan)} (needed bytes plus bridged gaps): {read / plan:.3f}x."
        )
        first_total = [max(r["first_s"]) / r["wall_s"] for r in spanwarm]
        lines.append(
            "Time to first tensor under spanwarm, as a share of its wall time: "
            f"{statistics.median(first_total):.1%}."
        )
    return lines


def memory_label(scenario: dict[str, Any]) -> str:
    return (
        f"; memory cgroup (v{scenario['cgroup_version']}) limit "
        f"{format_bytes(scenario['limit_bytes'])}: page cache room "
        f"{format_bytes(scenario['cache_room_bytes'])} ({scenario['fraction']:g} x the node "
        f"plan) + the processes' own {format_bytes(scenario['own_bytes'])} + "
        f"{format_bytes(CGROUP_SLACK)} slack; the daemon in it, its budget "
        f"{format_bytes(scenario['budget_bytes'])} "
        f"({scenario['budget_bytes'] / scenario['cache_room_bytes']:.2f}x the page cache room)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mounts", default="local,cross-region")
    parser.add_argument("--layouts", default="packed,per-expert")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--arms",
        default=",".join(BASE_ARMS),
        help=f"comma-separated, among {','.join(ARMS)} (spanwarm is needed)",
    )
    parser.add_argument(
        "--memory-limit",
        type=float,
        metavar="FRACTION",
        help="run the node in a memory cgroup with page cache room for FRACTION of the "
        "node plan's bytes (e.g. 0.5)",
    )
    parser.add_argument("--data", type=Path, default=Path("/var/tmp/spanwarm-bench"))
    parser.add_argument("--markdown", type=Path)
    parser.add_argument(
        "--json", type=Path, help="write each mount and layout's medians and paired ratios"
    )
    parser.add_argument(
        "--warm-reps",
        type=int,
        default=3,
        help="paired none/spanwarm runs with the checkpoint already resident (0: none; "
        "skipped under --memory-limit)",
    )
    parser.add_argument(
        "--resident-load",
        choices=("new", "in-place"),
        default="new",
        help="in the resident pairs, ranks copy into new tensors or into their own memory",
    )
    parser.add_argument(
        "--daemon-args", default="", help="extra `spanwarm serve` flags, e.g. '--method read'"
    )
    parser.add_argument(
        "--node",
        type=int,
        default=0,
        choices=range(WORLD // LOCAL_WORLD),
        help="which node's ranks run (0 holds every tensor's first rows; 1 holds none)",
    )
    args = parser.parse_args()
    arms = parse_arms(args.arms)
    command = "python bench/bench_end_to_end.py " + " ".join(sys.argv[1:])
    lines = [f"\n## End to end: the seed's scenario\n\n```console\n{command}\n```"]
    unavailable = peer_availability(arms)
    runnable = [arm for arm in arms if arm not in unavailable]
    cgroup = None
    if args.memory_limit is not None:
        made = create_memory_cgroup(f"spanwarm-bench-{os.getpid()}")
        if isinstance(made, str):
            print(f"--memory-limit: skipped, no memory cgroup can be set here ({made})")
            return
        cgroup = made
    rng = random.Random(0)
    figures: list[dict[str, Any]] = []
    try:
        for layout in args.layouts.split(","):
            source = args.data / f"moe-{layout}"
            paths = build_checkpoint(source, layout)
            total = sum(p.stat().st_size for p in paths)
            print(f"{layout}: {len(paths)} shards, {format_bytes(total)}", flush=True)
            for preset in args.mounts.split(","):
                figures.append({"mount": preset, "layout": layout})
                lines += run_mount(
                    args, runnable, arms, unavailable, rng, source, preset, cgroup, figures[-1]
                )
    finally:
        if cgroup is not None:
            cgroup.remove()
    text = "\n".join(lines) + "\n"
    print(text)
    if args.markdown:
        args.markdown.write_text(text)
    if args.json:
        args.json.write_text(json.dumps({"runs": figures}, indent=2) + "\n")


def run_mount(
    args: argparse.Namespace,
    runnable: list[str],
    arms: list[str],
    unavailable: dict[str, str],
    rng: random.Random,
    source: Path,
    preset: str,
    cgroup: MemoryCgroup | None,
    figures: dict[str, Any],
) -> list[str]:
    """One layout on one mount: the node's first load, then the repetitions (in the memory
    cgroup under ``--memory-limit``), then the resident pairs; its table's lines, its
    figures into ``figures``."""
    paths = sorted(source.glob("*.safetensors"))
    total = sum(p.stat().st_size for p in paths)
    daemon_args = args.daemon_args.split()
    discard = ("--discard",) if cgroup is not None else ()
    warm: dict[str, float] = {}
    scenario: dict[str, Any] = {}
    with (
        mounted(source, preset) as (checkpoint, fs),
        tempfile.TemporaryDirectory(prefix="sw-state-") as state,
    ):
        if cgroup is not None:
            daemon_args = state_dir_flags(daemon_args, state)
        mounted_paths = sorted(checkpoint.glob("*.safetensors"))
        with spawn_daemon("--log-level", "warning", *daemon_args) as daemon:
            # The first load: the daemon learns the mount (its seek cost probe).
            first = run_arm(
                "spanwarm",
                checkpoint,
                mounted_paths,
                daemon.socket,
                fs,
                node=args.node,
                rank_args=discard,
            )
            seek_cost = probed_seek_cost(daemon.socket, mounted_paths[0], daemon_args)
            print(f"  {preset}: seek cost {format_bytes(seek_cost)}", flush=True)
            spans, names = node_requests(checkpoint, args.node)
            limit_runs = plan_runs(checkpoint, spans, seek_cost, args.node)
            plan_bytes = sum(b - a for _, a, b in limit_runs)
            footprint = footprints(checkpoint, plan_bytes, names)
            own_bytes = first["anon_bytes"] + anonymous_memory(daemon.process.pid)
            if cgroup is None:
                runs = repetitions(
                    runnable,
                    args.reps,
                    rng,
                    preset,
                    limit_runs,
                    checkpoint,
                    mounted_paths,
                    daemon.socket,
                    fs,
                    node=args.node,
                )
                warm = warm_cache(
                    args.warm_reps,
                    checkpoint,
                    mounted_paths,
                    daemon.socket,
                    fs,
                    in_place=args.resident_load == "in-place",
                    node=args.node,
                )
        if cgroup is not None:
            cache_room = int(args.memory_limit * plan_bytes)
            limit = cgroup.set_limit(cache_room + own_bytes + CGROUP_SLACK)
            with daemon_in(cgroup, ["--log-level", "warning", *daemon_args]) as daemon:
                scenario = {
                    "fraction": args.memory_limit,
                    "cgroup": str(cgroup.directory),
                    "cgroup_version": cgroup.version,
                    "limit_bytes": limit,
                    "cache_room_bytes": cache_room,
                    "own_bytes": own_bytes,
                    "plan_bytes": plan_bytes,
                    "budget_bytes": daemon_budget(daemon.socket),
                    "daemon_pid": daemon.process.pid,
                }
                print(f"  {preset}: {json.dumps(scenario)}", flush=True)
                runs = repetitions(
                    runnable,
                    args.reps,
                    rng,
                    preset,
                    limit_runs,
                    checkpoint,
                    mounted_paths,
                    daemon.socket,
                    fs,
                    node=args.node,
                    cgroup=cgroup,
                    env=peer_memory_env(cache_room, largest_tensor(checkpoint)),
                    rank_args=discard,
                )
    label = (
        f"{source.name.removeprefix('moe-')} layout, {format_bytes(total)} in {len(paths)} "
        f"shards, mount `{preset}` (seek cost {format_bytes(seek_cost)}, as the daemon "
        f"probed it{memory_label(scenario) if scenario else ''})"
    )
    lines: list[str] = []
    if scenario:
        figures["memory_limit"] = scenario
    if runs:  # --reps 0: only the resident pairs
        lines += summarize(label, runs, arms, footprint, unavailable)
        figures.update(paired(runs))
        figures["unavailable"] = unavailable
    else:
        lines.append(f"\n### {label}\n")
    if warm:
        lines.append(
            f"Already resident (page cache warm, {args.warm_reps} paired runs, "
            f"{args.resident_load} tensors): none "
            f"{warm['none_s']:.2f} s, spanwarm {warm['spanwarm_s']:.2f} s, median "
            f"none/spanwarm {warm['none/spanwarm']:.2f}x; fastest of each arm "
            f"{1e3 * warm['fastest_none_s']:.1f} / "
            f"{1e3 * warm['fastest_spanwarm_s']:.1f} ms"
            f" ({warm['fastest none/spanwarm']:.2f}x); the slowest rank's request() "
            f"{1e3 * warm['request_s']:.1f} ms (median)."
        )
        figures["warm_cache"] = {**warm, "load": args.resident_load}
    return lines


if __name__ == "__main__":
    main()
