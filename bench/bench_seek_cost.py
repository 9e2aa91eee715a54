"""The learned seek cost against ``spanwarm calibrate``, on local storage and on each
emulated mount.

    .venv/bin/python bench/bench_seek_cost.py [--mounts local,nfs-like,cross-region]
        [--reps 3] [--size 512MiB] [--small-files N]

Per mount and rep: a fresh daemon with an empty state directory serves one load (one
rank's 64 MiB at the front of a cold shard, read and reported); once no request is live
the daemon probes the mount (docs/daemon.md, "The seek cost, probed per mount"), and the
bench polls Status until the figure shows, timing how long that took after the load
ended. Then ``spanwarm calibrate`` measures the same file as its command line does by
default. The target (issue 12): the learned figure within 2x of calibrate's after one
load; reported as the median of the paired ratios.

``--small-files N``: the load is N shards of 24 MiB instead (a DCP directory written by
many ranks: no file holds the probe's places alone), the first 8 MiB of each; calibrate
still measures the large shard on the same mount.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script, bench/ is on the path but its parent is not
    sys.path.insert(0, str(ROOT))

from bench.bench_end_to_end import mounted  # noqa: E402
from spanwarm.checkpoint.tensor_layout import TensorSpans  # noqa: E402
from spanwarm.client import Client  # noqa: E402
from spanwarm.pagecache.residency import evict  # noqa: E402
from spanwarm.planning.calibrate import calibrate  # noqa: E402
from spanwarm.testing.spawn import spawn_daemon  # noqa: E402
from spanwarm.units import format_bytes, parse_size  # noqa: E402

MiB = 2**20
LOAD_BYTES = 64 * MiB
TENSOR_BYTES = 8 * MiB
SMALL_BYTES = 24 * MiB


def shard(directory: Path, size: int) -> Path:
    """A shard of random bytes (written once, reused)."""
    path = directory / f"shard-{size}.bin"
    if not path.exists() or path.stat().st_size != size:
        rng = np.random.default_rng(0)
        with open(path, "wb") as f:
            for start in range(0, size, 64 * MiB):
                f.write(rng.integers(0, 256, min(64 * MiB, size - start), np.uint8).tobytes())
    return path


def small_shards(directory: Path, count: int) -> list[Path]:
    """``count`` shards of ``SMALL_BYTES`` (written once, reused)."""
    paths = []
    for i in range(count):
        path = directory / f"small-{i}.bin"
        if not path.exists() or path.stat().st_size != SMALL_BYTES:
            path.write_bytes(np.random.default_rng(i + 1).bytes(SMALL_BYTES))
        paths.append(path)
    return paths


def learned(paths: list[Path]) -> tuple[int, float]:
    """One load through a fresh daemon, then its probe: (seek cost, seconds after the load).
    One file: its first 64 MiB; several: the first 8 MiB of each."""
    for path in paths:
        evict(path)
    with spawn_daemon("--method", "read", "--log-level", "warning") as daemon:
        client = Client(daemon.socket)
        if len(paths) == 1:
            at = [(paths[0], i * TENSOR_BYTES) for i in range(LOAD_BYTES // TENSOR_BYTES)]
        else:
            at = [(path, 0) for path in paths]
        spans = [
            TensorSpans(f"t{i}", str(path), offset, TENSOR_BYTES, TENSOR_BYTES, 1)
            for i, (path, offset) in enumerate(at)
        ]
        ticket = client.request(spans)
        if not ticket.wait(timeout=600):
            raise RuntimeError("the load did not finish")
        ticket.consumed([s.tensor for s in spans])
        ticket.cancel()
        ended = time.monotonic()
        while time.monotonic() - ended < 600:
            mounts = client.status()["mounts"]
            if mounts and mounts[0]["seek_cost_bytes"]:
                client.close()
                return int(mounts[0]["seek_cost_bytes"]), time.monotonic() - ended
            time.sleep(0.1)
        raise RuntimeError("the daemon did not probe the mount within 600 s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mounts", default="local,nfs-like,cross-region")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--size", type=parse_size, default=512 * MiB)
    parser.add_argument("--dir", type=Path, default=Path("/var/tmp/spanwarm-bench/seek"))
    parser.add_argument("--small-files", type=int, default=0)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    command = "python bench/bench_seek_cost.py " + " ".join(
        a for a in sys.argv[1:] if not a.endswith(".md") and a != "--markdown"
    )
    args.dir.mkdir(parents=True, exist_ok=True)
    source = shard(args.dir, args.size)
    small = small_shards(args.dir, args.small_files)
    rows = []
    for preset in args.mounts.split(","):
        with mounted(source.parent, preset) as (directory, _):
            path = directory / source.name
            loaded = [directory / p.name for p in small] or [path]
            runs = []
            for rep in range(args.reps):  # paired: a fresh daemon's probe, then calibrate
                seek_cost, after_s = learned(loaded)
                calibrated = calibrate(str(path)).seek_cost
                runs.append((seek_cost, calibrated, after_s))
                print(
                    f"{preset} rep {rep}: learned {format_bytes(seek_cost)} {after_s:.1f} s "
                    f"after the load; calibrate {format_bytes(calibrated)}",
                    flush=True,
                )
        rows.append(
            f"| `{preset}` | {format_bytes(int(statistics.median(r[0] for r in runs)))} "
            f"({', '.join(format_bytes(r[0]) for r in runs)}) "
            f"| {format_bytes(int(statistics.median(r[1] for r in runs)))} "
            f"({', '.join(format_bytes(r[1]) for r in runs)}) "
            f"| {statistics.median(r[0] / r[1] for r in runs):.2f} "
            f"| {statistics.median(r[2] for r in runs):.1f} s |"
        )
    what = (
        f"the first 8 MiB of each of {args.small_files} cold 24 MiB shards"
        if small
        else f"64 MiB at the front of the cold {format_bytes(args.size)} shard"
    )
    text = "\n".join(
        [
            "\n## The learned seek cost\n",
            f"```console\n{command.strip()}\n```\n",
            f"Per mount: {args.reps} fresh daemons (empty state directories), each serving one "
            f"load ({what}) and then probing the mount once idle, each paired with a "
            f"`spanwarm calibrate` run on a cold {format_bytes(args.size)} shard of the same "
            "mount (evicted first). Target: within 2x.\n",
            "| mount | learned after one load: median (each rep) | `spanwarm calibrate`: "
            "median (each rep) | learned / calibrate, paired median | probe done, after the "
            "load |",
            "| --- | --- | --- | --- | --- |",
            *rows,
        ]
    )
    print(text)
    if args.markdown:
        args.markdown.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
