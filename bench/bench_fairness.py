"""Fair share between users: one user's load while another floods the daemon.

    sudo .venv/bin/python bench/bench_fairness.py [--runs 5] [--markdown PATH]

A root daemon (8 workers, ``--socket-group``) serves two unprivileged users (created
here with useradd) over an emulated network mount (src/spanwarm/testing/slowfs: 20 ms per seek,
8 MiB/s per stream, 64 MiB/s for the whole mount, so more streams mean more throughput
up to the mount's limit; slow enough that the storage, not the 2 CPUs serving the FUSE
mount, is what the users share). The *victim* warms a 64 MiB file; the *flooder*
keeps 20 Warm streams open over 20 files of 1 GiB it may read. Measured, each run with
the victim's file evicted first:

- the victim alone;
- the victim while the flooder floods (for 10 s before the first run: the daemon ranks
  users by the bytes it served them lately, with a half-life of 10 s);
- the victim's load sent under the flooder's own uid while it floods: what it would get
  if the daemon shared its workers per request instead of per user (20 streams to 1).

Reports medians and the ratio to the time alone. Needs root (users, FUSE allow_other).
"""

from __future__ import annotations

import argparse
import grp
import json
import os
import pwd
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from spanwarm.pagecache.residency import evict  # noqa: E402
from spanwarm.testing.slowfs import fuse_available, mount  # noqa: E402
from spanwarm.testing.spawn import spawn_daemon  # noqa: E402

MiB, GiB = 2**20, 2**30
GROUP, VICTIM, FLOODER = "swbench", "swb-victim", "swb-flood"
FLOOD_STREAMS = 20
USAGE_SETTLE_S = 20.0  # after the victim's runs alone: two half-lives of the usage decay
FLOOD_RAMP_S = 10.0  # the flood runs this long before the victim starts


def ensure_users() -> None:
    try:
        grp.getgrnam(GROUP)
    except KeyError:
        subprocess.run(["groupadd", GROUP], check=True)
    for name in (VICTIM, FLOODER):
        try:
            pwd.getpwnam(name)
        except KeyError:
            subprocess.run(
                ["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", "-G", GROUP, name],
                check=True,
            )


def client(user: str, socket: str, streams: int, paths: list[Path]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "bench" / "fairness_client.py"),
            user,
            socket,
            str(streams),
            *map(str, paths),
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )


def load(user: str, socket: str, path: Path) -> float:
    evict(path)
    proc = client(user, socket, 1, [path])
    out, _ = proc.communicate(timeout=300)
    result = json.loads(out)
    assert result["ready"] == result["groups"] == 1, result
    return float(result["seconds"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    why = "not root (it creates users)" if os.geteuid() != 0 else fuse_available()
    if why:
        print(f"bench_fairness: skipped: {why}")
        return
    ensure_users()
    work = Path(tempfile.mkdtemp(prefix="swfair-", dir="/tmp"))
    work.chmod(0o755)
    source, mnt, run = work / "src", work / "mnt", work / "run"
    for d in (source, run):
        d.mkdir(mode=0o755)
    victim_file = source / "victim.bin"
    victim_file.write_bytes(os.urandom(64 * MiB))
    victim_file.chmod(0o644)
    flood_files = []
    for i in range(FLOOD_STREAMS):
        f = source / f"flood-{i:02d}.bin"
        with open(f, "wb") as out:
            out.truncate(GiB)  # sparse: the mount's costs apply all the same
        f.chmod(0o644)
        flood_files.append(f)
    rows: dict[str, list[float]] = {"alone": [], "flood": [], "same uid": []}
    with mount(
        source,
        mnt,
        "local",
        latency_s=0.02,
        stream_bytes_per_s=8 * MiB,
        total_bytes_per_s=64 * MiB,
        allow_other=True,
    ):
        target = mnt / "victim.bin"
        floods = [mnt / f.name for f in flood_files]
        with spawn_daemon(
            "--socket-group",
            GROUP,
            "--allow",
            str(mnt),
            "--workers",
            "8",
            socket_path=str(run / "d.sock"),
        ) as daemon:
            rows["alone"] = [load(VICTIM, daemon.socket, target) for _ in range(args.runs)]
            for label, user in (("flood", VICTIM), ("same uid", FLOODER)):
                # The daemon ranks users by bytes served lately (half-life 10 s): let the
                # victim's runs alone fade, and the flood run long enough to be one.
                time.sleep(USAGE_SETTLE_S)
                for f in floods:
                    evict(f)
                flooder = client(FLOODER, daemon.socket, FLOOD_STREAMS, floods)
                try:
                    time.sleep(FLOOD_RAMP_S)
                    rows[label] = [load(user, daemon.socket, target) for _ in range(args.runs)]
                finally:
                    flooder.kill()
                    flooder.wait()
                time.sleep(1.0)  # its streams end, its requests leave the node
    alone = statistics.median(rows["alone"])
    lines = [
        "| victim's 64 MiB load | median | runs (s) | vs alone |",
        "| --- | --- | --- | --- |",
    ]
    for label, times in rows.items():
        median = statistics.median(times)
        runs = ", ".join(f"{t:.2f}" for t in times)
        lines.append(f"| {label} | {median:.2f} s | {runs} | {median / alone:.2f}x |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.markdown:
        args.markdown.write_text(text)
    subprocess.run(["rm", "-rf", str(work)], check=False)


if __name__ == "__main__":
    main()
