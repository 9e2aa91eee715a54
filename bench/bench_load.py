"""Load: many rank processes on one daemon, and many short requests in a row.

    .venv/bin/python bench/bench_load.py [--ranks 64] [--spans 10000] [--sequential 1000]
        [--quick] [--daemon-nice N] [--markdown PATH] [--samples PATH]

A real daemon (``spawn_daemon``, default flags but ``--log-level warning``) on a private
socket, a fresh one per scenario; shared files of random bytes in a temporary directory
(``--files`` x ``--file-size``), evicted before each scenario.

- A: ``--ranks`` client processes (bench/load_client.py, which imports only
  spanwarm.client) start together at a barrier and each send one request of ``--spans``
  spans of 4-64 KiB, 10 per tensor in read order, overlapping between ranks. Each checks
  with mincore, on its own descriptors, that every tensor reported ready is resident right
  then, reports all its tensors consumed and waits for its stream to end. Meanwhile this
  process calls Status in a tight loop (one channel, 10 s timeout per call) and records
  its latency during admission (from the barrier until every rank has received its plan)
  and during warming (from then until every rank has all its tensors ready); beside it,
  a thread sends one byte to an echo process and back, over and over: the floor that any
  local request and answer have on the loaded node.
- B: ``--sequential`` requests one after another from this process, each 4 spans of
  16 KiB in a region no earlier request touched (cold): request, wait for all ready
  (checking residency the same way), report consumed, wait for the stream's end.

For both, the daemon's RSS (VmRSS) and open descriptors (/proc/PID/fd) before (idle,
after one Status call), at peak (sampled every 50 ms) and after: 2 s after the last stream
ended, or, while descriptors are above idle, once they are back (the idle seek probe holds
a copy of each candidate file's until it has run, two idle seconds on), 60 s at most.
Progress goes to stderr.

Exits 1 if a tensor failed or was released, a ready tensor was not resident, or the
daemon's descriptors did not return to their count before. Some machines evict idle page
cache on their own (a DAMON ``pageout`` scheme, proactive reclaim): in A, a page monitor
(mincore of the shared files every 100 ms) tells a tensor whose missing pages had all been
seen resident before the rank's check (warm, then evicted by the machine: reported, not a
failure unless ``--strict``) from one never seen resident before it (a failure).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import multiprocessing
import os
import shutil
import socket as socket_module
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event as EventType
from pathlib import Path
from typing import IO, Any

import grpc
import numpy as np
import numpy.typing as npt

from spanwarm.client import Client, TensorSpans
from spanwarm.pagecache.memory_map import mapped, mincore
from spanwarm.pagecache.residency import PAGE, evict, resident_bytes
from spanwarm.testing.spawn import spawn_daemon
from spanwarm.units import format_bytes, parse_size

HERE = Path(__file__).resolve().parent
KiB, MiB = 2**10, 2**20
SETTLE_S = 2.0  # after the last stream ended, before the "after" sample
# The idle seek probe keeps a descriptor of each candidate file (a copy of the request's)
# until it has run, which it does once no request has been live for two seconds: the
# "after" sample waits for the descriptors to come back this long at most.
PROBE_SETTLE_S = 60.0


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def write_files(directory: Path, count: int, size: int) -> list[str]:
    """``count`` files of ``size`` random bytes, synced and evicted."""
    paths = []
    for i in range(count):
        path = directory / f"shard-{i}.bin"
        rng = np.random.default_rng(i)
        with open(path, "wb") as f:
            for start in range(0, size, 16 * MiB):
                f.write(rng.bytes(min(16 * MiB, size - start)))
            f.flush()
            os.fsync(f.fileno())
        evict(path)
        paths.append(str(path))
    return paths


def percentiles(samples: list[float]) -> str:
    """p50 / p99 / max of ``samples`` (seconds) in milliseconds."""
    if not samples:
        return "no samples"
    ms = sorted(s * 1000 for s in samples)
    p99 = ms[min(len(ms) - 1, int(len(ms) * 0.99))]
    return (
        f"p50 {statistics.median(ms):.1f} ms, p99 {p99:.1f} ms, max {ms[-1]:.1f} ms (n={len(ms)})"
    )


# -- the daemon's footprint ------------------------------------------------------------


def footprint(pid: int) -> tuple[int, int]:
    """(RSS bytes, open descriptors) of process ``pid``."""
    rss = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) * KiB
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


class Footprint:
    """The daemon's RSS and descriptors: before, peak (every 50 ms while running), after."""

    def __init__(self, pid: int, socket: str) -> None:
        self.pid = pid
        # Idle, but after one call: the first connection may set up lasting state.
        with Client(socket) as client:
            client.status()
        time.sleep(0.5)
        self.before = footprint(pid)
        self.peak = self.before
        self.after = self.before
        self.current = self.before
        self.settled_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.05):
            self._take()

    def _take(self) -> None:
        try:
            self.current = footprint(self.pid)
        except (FileNotFoundError, ProcessLookupError):
            return  # the daemon died; the scenario reports it
        self.peak = (max(self.peak[0], self.current[0]), max(self.peak[1], self.current[1]))

    def finish(self) -> None:
        """Stop sampling; take the "after" sample ``SETTLE_S`` from now, or, while the
        descriptors are above idle, once they are back (the idle seek probe's copies),
        ``PROBE_SETTLE_S`` at most."""
        began = time.monotonic()
        time.sleep(SETTLE_S)
        self._stop.set()
        self._thread.join()
        self._take()
        while self.current[1] > self.before[1] and time.monotonic() - began < PROBE_SETTLE_S:
            time.sleep(0.5)
            self._take()
        self.after = self.current
        self.settled_s = time.monotonic() - began

    def rows(self) -> list[tuple[str, str]]:
        (rb, fb), (rp, fp), (ra, fa) = self.before, self.peak, self.after
        return [
            (
                "daemon RSS before / peak / after",
                f"{rb / MiB:.0f} / {rp / MiB:.0f} / {ra / MiB:.0f} MiB",
            ),
            ("daemon fds before / peak / after", f"{fb} / {fp} / {fa}"),
            ("after: sampled this long after the last stream ended", f"{self.settled_s:.1f} s"),
        ]


# -- the shared files' page cache -------------------------------------------------------


def _watch_pages(paths: list[str], conn: Connection, stop: EventType) -> None:
    """The page monitor's process: sample until ``stop``, then send the findings."""
    with contextlib.suppress(OSError):  # not starved by the ranks it watches (needs root)
        os.setpriority(os.PRIO_PROCESS, 0, -10)
    fds = [os.open(p, os.O_RDONLY | os.O_CLOEXEC) for p in paths]
    sizes = [os.fstat(fd).st_size for fd in fds]
    first_seen = [np.full(-(-n // PAGE), np.inf) for n in sizes]
    last = [np.zeros(-(-n // PAGE), dtype=bool) for n in sizes]
    evicted = 0
    samples: list[float] = []
    while True:
        for i, (fd, size) in enumerate(zip(fds, sizes, strict=True)):
            with mapped(fd, 0, size) as addr:
                now = time.monotonic()
                bits = (np.frombuffer(mincore(addr, size), dtype=np.uint8) & 1).astype(bool)
            np.minimum(first_seen[i], np.where(bits, now, np.inf), out=first_seen[i])
            evicted += int(np.count_nonzero(last[i] & ~bits))
            last[i] = bits
        samples.append(time.monotonic())
        if len(samples) == 1:
            conn.send("started")
        if stop.wait(0.1):
            break
    for fd in fds:
        os.close(fd)
    conn.send((first_seen, samples, evicted))


class PageMonitor:
    """Every 100 ms, which pages of the shared files are resident (mincore, in a process
    of its own at a higher priority): when each was first seen resident, and how many went
    from resident to not (evicted by the machine: nothing in the daemon or the benchmark
    drops pages once a scenario runs).

    A tensor a rank found not resident whose missing pages had all been seen resident
    before its check was evicted after it was warm; any other is unexplained."""

    def __init__(self, paths: list[str]) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe(duplex=False)
        self._stop = context.Event()
        self._process = context.Process(
            target=_watch_pages, args=(paths, child, self._stop), daemon=True
        )
        self.first_seen: list[npt.NDArray[np.float64]] = []
        self.samples: list[float] = []
        self.evicted_pages = 0

    def __enter__(self) -> PageMonitor:
        self._process.start()
        if not self._conn.poll(60) or self._conn.recv() != "started":
            raise RuntimeError("the page monitor did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._conn.poll(60):
            self.first_seen, self.samples, self.evicted_pages = self._conn.recv()
        self._process.join(10)

    def explain(self, pages: list[list[int]], checked_at: float) -> str:
        """Of a tensor whose pages ([file, page]) were missing when a rank checked at
        ``checked_at``: "evicted" when every one had been seen resident before (warm, then
        evicted), "later" when one was first seen resident only after the check, "never"
        when one was never seen resident."""
        seen = [self.first_seen[f][p] for f, p in pages]
        if seen and all(t <= checked_at for t in seen):
            return "evicted"
        return "never" if any(t == np.inf for t in seen) else "later"

    def gap(self, start: float, end: float) -> float:
        """The longest time between two samples in [start, end] (seconds)."""
        times = [start, *(t for t in self.samples if start < t < end), end]
        return max(b - a for a, b in itertools.pairwise(times))


def proactive_reclaim() -> str | None:
    """A line naming a DAMON scheme that pages out idle memory here, if one is running."""
    root = Path("/sys/kernel/mm/damon/admin/kdamonds")
    try:
        for kdamond in root.glob("[0-9]*"):
            if (kdamond / "state").read_text().strip() != "on":
                continue
            for action in kdamond.glob("contexts/*/schemes/*/action"):
                if action.read_text().strip() == "pageout":
                    return (
                        f"this machine runs a DAMON `pageout` scheme ({action.parent}): "
                        "idle page cache is evicted every few seconds without memory pressure"
                    )
    except OSError:
        return None
    return None


def renice(pid: int, nice: int | None) -> None:
    """Run the daemon as the systemd unit's ``Nice=`` would: every thread of it at ``nice``
    (threads started later inherit it), its helper processes 10 above."""
    if nice is None:
        return
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.setpriority(os.PRIO_PROCESS, int(tid), nice)
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    for child in children:
        for tid in os.listdir(f"/proc/{child}/task"):
            os.setpriority(os.PRIO_PROCESS, int(tid), min(nice + 10, 19))


# -- Status in a tight loop ------------------------------------------------------------


_ECHO_SERVER = """
import socket, sys
listener = socket.socket(socket.AF_UNIX)
listener.bind(sys.argv[1])
listener.listen(1)
print("ready", flush=True)
connection, _ = listener.accept()
while data := connection.recv(64):
    connection.sendall(data)
"""


class EchoPoller:
    """The floor under Status's latency on a loaded node: one byte sent to an echo process
    (plain Python, no work per call) and back, over a Unix socket, back to back beside the
    Status calls; (start, seconds, ok) per round trip. Both processes compete for the
    cores with the ranks the way the daemon and its caller do."""

    def __init__(self, directory: str) -> None:
        path = os.path.join(directory, "echo.sock")
        self._server = subprocess.Popen(
            [sys.executable, "-c", _ECHO_SERVER, path], stdout=subprocess.PIPE, text=True
        )
        assert self._server.stdout is not None
        self._server.stdout.readline()
        self._socket = socket_module.socket(socket_module.AF_UNIX)
        self._socket.connect(path)
        self.samples: list[tuple[float, float, bool]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            start = time.monotonic()
            self._socket.sendall(b"x")
            ok = self._socket.recv(64) == b"x"
            self.samples.append((start, time.monotonic() - start, ok))
            time.sleep(0.001)  # as often as Status is called, about

    def __enter__(self) -> EchoPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._socket.close()
        self._server.kill()
        self._server.wait()

    def between(self, start: float, end: float) -> list[float]:
        return [s for t, s, _ in self.samples if start <= t < end]


class StatusPoller:
    """Calls Status back to back on one channel; (start, seconds, ok) per call; and beside
    it, an echo's round trips (``echo``)."""

    def __init__(self, socket: str) -> None:
        self.socket = socket
        self._directory = tempfile.mkdtemp(prefix="sw-echo-")
        self.echo = EchoPoller(self._directory)
        self.samples: list[tuple[float, float, bool]] = []
        self.errors: list[str] = []
        self.last: dict[str, Any] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        with Client(self.socket, timeout=10.0) as client:
            while not self._stop.is_set():
                start = time.monotonic()
                try:
                    self.last = client.status()
                    ok = True
                except grpc.RpcError as exc:
                    ok = False
                    self.errors.append(f"{exc.code().name}: {exc.details()}")
                self.samples.append((start, time.monotonic() - start, ok))

    def __enter__(self) -> StatusPoller:
        self.echo.__enter__()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.echo.__exit__()
        shutil.rmtree(self._directory, ignore_errors=True)

    def between(self, start: float, end: float) -> tuple[list[float], int]:
        """Latencies of the calls started in [start, end), and how many of them failed."""
        chosen = [(s, ok) for t, s, ok in self.samples if start <= t < end]
        return [s for s, _ in chosen], sum(1 for _, ok in chosen if not ok)


# -- scenario A: many ranks ------------------------------------------------------------


class Rank:
    """One client process and the JSON lines it printed."""

    def __init__(self, rank: int, command: list[str], changed: threading.Condition) -> None:
        self.rank = rank
        self.events: dict[str, dict[str, Any]] = {}
        self._changed = changed
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        stdout: IO[str] | None = self.process.stdout
        assert stdout is not None
        for line in stdout:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                log(f"rank {self.rank}: {line.rstrip()}")
                continue
            with self._changed:
                self.events[record["event"]] = record
                self._changed.notify_all()
        self.process.wait()
        with self._changed:
            self._changed.notify_all()

    def go(self) -> None:
        stdin = self.process.stdin
        assert stdin is not None
        stdin.write("go\n")
        stdin.flush()
        stdin.close()

    @property
    def exited(self) -> bool:
        return self.process.poll() is not None


def scenario_a(args: argparse.Namespace, paths: list[str]) -> tuple[list[tuple[str, str]], bool]:
    for path in paths:
        evict(path)
    ranks_n, spans_n = args.ranks, args.spans
    log(f"A: {ranks_n} ranks x {spans_n:,} spans; starting the daemon")
    with (
        PageMonitor(paths) as pages,
        spawn_daemon("--log-level", "warning") as daemon,
    ):
        renice(daemon.process.pid, args.daemon_nice)
        fp = Footprint(daemon.process.pid, daemon.socket)
        changed = threading.Condition()
        command = [
            sys.executable,
            str(HERE / "load_client.py"),
            "--socket",
            daemon.socket,
            "--spans",
            str(spans_n),
            "--files",
            ",".join(paths),
            "--timeout",
            str(args.timeout),
            "--stall-timeout",
            str(args.stall_timeout),
        ]
        ranks: list[Rank] = []
        try:
            # extend() keeps the processes started before a failure: the finally kills them
            ranks.extend(Rank(i, [*command, "--rank", str(i)], changed) for i in range(ranks_n))
            stopped, go, poller = run_ranks(args, ranks, changed, daemon.socket, fp)
        finally:
            for r in ranks:
                if r.process.poll() is None:
                    r.process.kill()
                    r.process.wait()
        fp.finish()
        codes = [r.process.wait() for r in ranks]
        if daemon.process.poll() is not None:
            log(f"A: the daemon exited with {daemon.process.returncode}")
    return summarize_a(args, ranks, codes, stopped, go, poller, fp, pages)


def run_ranks(
    args: argparse.Namespace,
    ranks: list[Rank],
    changed: threading.Condition,
    socket: str,
    fp: Footprint,
) -> tuple[float, float, StatusPoller]:
    """Release the barrier, follow the ranks until they have all exited, with Status
    polled throughout; returns (when they had all exited, when the barrier opened, poller)."""
    ranks_n = len(ranks)

    def count(event: str) -> int:
        return sum(1 for r in ranks if event in r.events)

    deadline = time.monotonic() + args.timeout
    with changed:
        while count("built") < ranks_n:
            if any(r.exited and "built" not in r.events for r in ranks):
                raise SystemExit("A: a client process exited before building its spans")
            if time.monotonic() > deadline:
                raise SystemExit("A: the client processes did not build their spans in time")
            changed.wait(1.0)
    log(f"A: {ranks_n} clients built their spans; go")

    with StatusPoller(socket) as poller:
        time.sleep(0.5)  # a few idle calls first
        go = time.monotonic()
        for r in ranks:
            r.go()
        next_report = go + 5
        last_change = go
        seen: tuple[Any, ...] = ()
        with changed:
            while not all(r.exited for r in ranks):
                now = time.monotonic()
                if now > deadline + 60:
                    raise SystemExit("A: the clients did not finish in time")
                status = poller.last
                state = (
                    count("plan"),
                    count("result"),
                    sum(r.exited for r in ranks),
                    status.get("bytes_warm"),
                    status.get("bytes_planned"),
                    len(status.get("ranks", ())),
                )
                if state != seen:
                    last_change, seen = now, state
                elif now - last_change > args.stall:
                    raise SystemExit(
                        f"A: no progress for {args.stall:.0f} s (no plan, result or change "
                        "in the daemon's Status): the daemon looks stuck"
                    )
                changed.wait(max(0.01, next_report - time.monotonic()))
                if time.monotonic() >= next_report:
                    next_report += 5
                    log(
                        f"A +{time.monotonic() - go:.0f} s: planned {count('plan')}, "
                        f"done {count('result')}, exited "
                        f"{sum(r.exited for r in ranks)} of {ranks_n}; daemon RSS "
                        f"{fp.current[0] / MiB:.0f} MiB, {fp.current[1]} fds; warm "
                        f"{format_bytes(int(status.get('bytes_warm', 0)))} of "
                        f"{format_bytes(int(status.get('bytes_planned', 0)))} planned, "
                        f"queue {status.get('queue_depth', '?')}; Status calls "
                        f"{len(poller.samples)}, last "
                        f"{poller.samples[-1][1] * 1000 if poller.samples else 0:.1f} ms"
                    )
        stopped = time.monotonic()
    return stopped, go, poller


def summarize_a(
    args: argparse.Namespace,
    ranks: list[Rank],
    codes: list[int],
    stopped: float,
    go: float,
    poller: StatusPoller,
    fp: Footprint,
    pages: PageMonitor,
) -> tuple[list[tuple[str, str]], bool]:
    ranks_n, spans_n = args.ranks, args.spans
    results = [r.events.get("result") for r in ranks]
    missing = [r.rank for r, res in zip(ranks, results, strict=True) if res is None]
    got = [res for res in results if res is not None]
    plans = [r.events["plan"]["t"] for r in ranks if "plan" in r.events]
    all_ready = [res["start"] + res["all_ready_s"] for res in got if res["all_ready_s"] is not None]
    ends = [res["start"] + res["end_s"] for res in got]
    admitted = max(plans) if len(plans) == ranks_n else (max(all_ready) if all_ready else stopped)
    warmed = max(all_ready) if all_ready else stopped

    def total(key: str) -> int:
        return sum(int(res[key]) for res in got)

    tensors, ready = total("tensors"), total("ready")
    failed, released, timed_out = total("failed"), total("released"), total("timed_out")
    not_resident, checked = total("not_resident"), total("checked")
    details = [d for res in got for d in res["not_resident_pages"]]
    why = [pages.explain(d["pages"], d["t"]) for d in details]
    evicted = why.count("evicted")
    unexplained = not_resident - evicted  # includes any beyond the detail cap
    if unexplained:
        log(
            f"A: of the {unexplained} not seen resident before the check: "
            f"{why.count('later')} first seen resident only after it, {why.count('never')} "
            f"never seen resident, {not_resident - len(details)} beyond the detail cap; the "
            f"page monitor's longest gap between samples was "
            f"{pages.gap(go, warmed):.2f} s"
        )
    if args.samples:
        write_samples(args.samples, poller, go, admitted, warmed)
    idle, idle_err = poller.between(0, go)
    admission, adm_err = poller.between(go, admitted)
    warming, warm_err = poller.between(admitted, warmed)
    echo_admission = poller.echo.between(go, admitted)
    echo_warming = poller.echo.between(admitted, warmed)
    plan_s = [res["plan_s"] for res in got if res["plan_s"] is not None]
    ready_s = [res["all_ready_s"] for res in got if res["all_ready_s"] is not None]
    rows = [
        ("ranks x spans (one request each)", f"{ranks_n} x {spans_n:,}"),
        ("bytes requested (all ranks)", format_bytes(total("bytes"))),
        ("tensors ready / total", f"{ready:,} / {tensors:,}"),
        ("tensors failed / released / timed out", f"{failed} / {released} / {timed_out}"),
        ("ready but not resident when checked (of checked)", f"{not_resident} (of {checked:,})"),
        ("... evicted by the machine after being warm", str(evicted)),
        ("... never seen resident before the check", str(unexplained)),
        (
            "shared-file pages the machine evicted during the run",
            f"{pages.evicted_pages:,} ({format_bytes(pages.evicted_pages * PAGE)})",
        ),
        ("page monitor: longest gap between samples", f"{pages.gap(go, warmed):.2f} s"),
        ("wall: barrier to last stream ended", f"{max(ends, default=stopped) - go:.1f} s"),
        ("admission: barrier to last plan received", f"{admitted - go:.1f} s"),
        ("per rank, plan received (median / max)", _median_max(plan_s)),
        ("per rank, all ready (median / max)", _median_max(ready_s)),
        ("Status, idle", percentiles(idle) + _errors(idle_err)),
        ("Status, during admission", percentiles(admission) + _errors(adm_err)),
        ("Status, during warming", percentiles(warming) + _errors(warm_err)),
        ("the floor: an echo's round trip, during admission", percentiles(echo_admission)),
        ("the floor: an echo's round trip, during warming", percentiles(echo_warming)),
        *fp.rows(),
    ]
    problems = []
    if missing:
        problems.append(f"ranks without a result: {missing[:10]}")
    if any(codes):
        problems.append(f"client exit codes: {sorted(set(codes))}")
    if failed or released or timed_out:
        first = next((res["first_failure"] for res in got if res["first_failure"]), None)
        problems.append(
            f"{failed} failed, {released} released, {timed_out} timed out (first: {first})"
        )
    if not_resident:
        later = total("not_resident_later")
        message = (
            f"{not_resident} tensors ready but not resident when checked, in "
            f"{sum(1 for res in got if res['not_resident'])} ranks; {later} of them still "
            f"not resident once the rank had all its tensors; {evicted} had been seen "
            f"resident before the check (evicted), {unexplained} had not"
        )
        for res in got:
            if res["not_resident"]:
                log(f"A: rank {res['rank']}: {res['not_resident']}: {res['not_resident_first']}")
        if unexplained or args.strict:
            problems.append(message)
        else:
            log(f"A: note: {message}")
    if fp.after[1] != fp.before[1]:
        problems.append(f"daemon fds {fp.before[1]} before, {fp.after[1]} after")
    if poller.errors:  # reported, not fatal: the latency figures show them
        log(f"A: {len(poller.errors)} Status calls failed (first: {poller.errors[0]})")
    for problem in problems:
        log(f"A: PROBLEM: {problem}")
    return rows, not problems


def write_samples(
    path: Path, poller: StatusPoller, go: float, admitted: float, warmed: float
) -> None:
    """Every Status call of scenario A, as (start, seconds, ok) with the phases' bounds (the
    clock is ``time.monotonic()``, system-wide: it lines up with a trace of the daemon)."""
    record = {"go": go, "admitted": admitted, "warmed": warmed, "samples": poller.samples}
    path.write_text(json.dumps(record))


def _median_max(values: list[float]) -> str:
    if not values:
        return "none"
    return f"{statistics.median(values):.1f} s / {max(values):.1f} s"


def _errors(n: int) -> str:
    return f", {n} errors" if n else ""


# -- scenario B: many short requests ---------------------------------------------------


def scenario_b(args: argparse.Namespace, paths: list[str]) -> tuple[list[tuple[str, str]], bool]:
    for path in paths:
        evict(path)
    n = args.sequential
    fds = {p: os.open(p, os.O_RDONLY | os.O_CLOEXEC) for p in paths}
    size = os.fstat(fds[paths[0]]).st_size
    regions = -(-n // len(paths))
    region = size // regions
    log(f"B: {n} sequential requests; starting the daemon")
    times: list[float] = []
    failed = released = not_resident = timed_out = unended = 0
    first_failure: tuple[str, str] | None = None
    with spawn_daemon("--log-level", "warning") as daemon:
        renice(daemon.process.pid, args.daemon_nice)
        fp = Footprint(daemon.process.pid, daemon.socket)
        start = time.monotonic()
        with Client(daemon.socket, stall_timeout=args.stall_timeout) as client:
            for i in range(n):
                path = paths[i % len(paths)]
                base = (i // len(paths)) * region
                spans = [
                    TensorSpans(
                        f"t{j}", path, base + j * (region // 4) + 100, 16 * KiB, 16 * KiB, 1
                    )
                    for j in range(4)
                ]
                names = [s.tensor for s in spans]
                t0 = time.monotonic()
                ticket = client.request(spans, job="bench-sequential", rank=0)
                if not ticket.wait(timeout=args.timeout):
                    timed_out += 1
                progress = ticket.progress
                failed += len(ticket.failures)
                released += progress.failed - len(ticket.failures)
                if progress.failed == len(ticket.failures):  # none released: ready = warm
                    for s in spans:
                        if not ticket.ready(s.tensor) or s.tensor in ticket.failures:
                            continue
                        if resident_bytes(fds[s.path], s.offset, s.length) != s.length:
                            not_resident += 1
                if ticket.failures and first_failure is None:
                    first_failure = next(iter(ticket.failures.items()))
                ticket.consumed(names)
                if not ticket.finished.wait(args.timeout):
                    unended += 1
                times.append(time.monotonic() - t0)
                if (i + 1) % max(1, n // 10) == 0:
                    log(
                        f"B: {i + 1}/{n} requests, {time.monotonic() - start:.1f} s; daemon RSS "
                        f"{fp.current[0] / MiB:.0f} MiB, {fp.current[1]} fds"
                    )
        wall = time.monotonic() - start
        fp.finish()
    for fd in fds.values():
        os.close(fd)
    rows = [
        ("requests x spans (16 KiB, cold)", f"{n:,} x 4"),
        ("requests per second", f"{n / wall:.0f} /s ({wall:.1f} s in all)"),
        ("per request: request to stream ended", percentiles(times)),
        ("tensors failed / released / timed out", f"{failed} / {released} / {timed_out}"),
        ("ready but not resident", str(not_resident)),
        ("streams that did not end", str(unended)),
        *fp.rows(),
    ]
    problems = []
    if failed or released or timed_out:
        problems.append(f"{failed} failed, {released} released, {timed_out} timed out")
        if first_failure:
            problems.append(f"first failure: {first_failure}")
    if not_resident:
        problems.append(f"{not_resident} ready but not resident")
    if unended:
        problems.append(f"{unended} streams did not end")
    if fp.after[1] != fp.before[1]:
        problems.append(f"daemon fds {fp.before[1]} before, {fp.after[1]} after")
    for problem in problems:
        log(f"B: PROBLEM: {problem}")
    return rows, not problems


# -- output ----------------------------------------------------------------------------


def table(rows: list[tuple[str, str]]) -> list[str]:
    return ["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)]


def command_line() -> str:
    """This run's command, without --markdown PATH (where run_all.py collects it)."""
    argv, shown = sys.argv[1:], []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--markdown":
            skip = True
        elif not arg.startswith("--markdown="):
            shown.append(arg)
    return " ".join(["python bench/bench_load.py", *shown])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=None, help="client processes (64)")
    parser.add_argument("--spans", type=int, default=None, help="spans per rank (10000)")
    parser.add_argument(
        "--sequential", type=int, default=None, help="requests in scenario B (1000)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="16 ranks x 2,000 spans, 200 sequential"
    )
    parser.add_argument("--files", type=int, default=4, help="shared files")
    parser.add_argument("--file-size", default="256MiB", help="size of each shared file")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds a scenario may take")
    parser.add_argument(
        "--stall-timeout",
        type=float,
        default=300.0,
        help="the clients' stall watchdog: release a request after this long without progress",
    )
    parser.add_argument(
        "--stall",
        type=float,
        default=300.0,
        help="give up on scenario A after this long with no sign of progress",
    )
    parser.add_argument(
        "--strict",
        action="store_true",
        help="fail on any ready tensor not resident, even one the machine evicted after it "
        "was seen warm",
    )
    parser.add_argument(
        "--daemon-nice",
        type=int,
        default=None,
        help="run the daemon at this niceness, as the systemd unit does (Nice=-5; root only)",
    )
    parser.add_argument("--markdown", type=Path, help="write the section to this file")
    parser.add_argument(
        "--samples",
        type=Path,
        help="write scenario A's Status calls (start, seconds, ok) and its phases as JSON",
    )
    args = parser.parse_args()
    quick = (16, 2000, 200) if args.quick else (64, 10_000, 1000)
    args.ranks = quick[0] if args.ranks is None else args.ranks
    args.spans = quick[1] if args.spans is None else args.spans
    args.sequential = quick[2] if args.sequential is None else args.sequential
    size = parse_size(args.file_size)

    with tempfile.TemporaryDirectory(prefix="sw-load-", dir="/var/tmp") as tmp:
        log(f"writing {args.files} x {format_bytes(size)} of random bytes")
        paths = write_files(Path(tmp), args.files, size)
        rows_a, ok_a = scenario_a(args, paths) if args.ranks > 0 else ([], True)
        rows_b, ok_b = scenario_b(args, paths) if args.sequential > 0 else ([], True)

    lines = [
        "\n## Load: many ranks and many requests\n",
        f"```console\n{command_line()}\n```\n",
        f"One daemon (default flags) per scenario; {args.files} shared files of "
        f"{format_bytes(size)} of random bytes, evicted first. A: rank processes (importing "
        "only `spanwarm.client`) start together and each send one request of 4-64 KiB spans, "
        "10 per tensor, overlapping between ranks; each checks with mincore that every tensor "
        "reported ready is resident at that moment, then reports all consumed. Status is "
        "called back to back meanwhile (admission: until every rank has its plan; warming: "
        "from then until every rank has all its tensors); beside it, one byte to an echo "
        "process and back, over and over: the floor of any local call on the loaded node. "
        "B: one client sends requests one "
        "after another (request, all ready, consumed, stream ended). The daemon's RSS and "
        "descriptors: idle before, peak (every 50 ms), and after: 2 s after the last stream "
        "ended, or once the descriptors are back to idle (the idle seek probe keeps a copy "
        "of each candidate file's until it has run), 60 s at most.\n",
    ]
    reclaim = proactive_reclaim()
    if reclaim:
        lines.append(
            f"Note: {reclaim}. A tensor found not resident whose missing pages had all been "
            "seen resident (mincore of the shared files every 100 ms) before the rank's "
            "check was warm and then evicted by the machine; only the others count as "
            "failures (`--strict` counts all).\n"
        )
    if rows_a:
        lines += [f"### A: {args.ranks} ranks x {args.spans:,} spans at once\n", *table(rows_a)]
    if rows_b:
        lines += [f"\n### B: {args.sequential:,} sequential short requests\n", *table(rows_b)]
    text = "\n".join(lines) + "\n"
    print(text, flush=True)
    if args.markdown:
        args.markdown.write_text(text)
    if not (ok_a and ok_b):
        log("FAILED: see the PROBLEM lines above")
        sys.exit(1)


if __name__ == "__main__":
    main()
