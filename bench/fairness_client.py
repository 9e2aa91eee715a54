"""One user's load for bench/bench_fairness.py, run as that user.

    python bench/fairness_client.py USER SOCKET STREAMS PATH [PATH ...]

Starts as root (the interpreter lives under /root, which other users cannot reach),
imports what it needs, drops to USER for good (groups, gid, uid), then opens STREAMS
Warm requests (stream i warms PATH[i % len(PATH)] whole), waits until every tensor is
ready, and prints ``{"seconds": ..., "ready": ..., "groups": ...}``. The clock starts
just before the first request.
"""

from __future__ import annotations

import json
import os
import pwd
import sys
import time

import grpc
import numpy as np

from spanwarm.client import Client, TensorSpans


def drop_to(user: str) -> None:
    entry = pwd.getpwnam(user)
    os.setgroups(os.getgrouplist(user, entry.pw_gid))
    os.setresgid(entry.pw_gid, entry.pw_gid, entry.pw_gid)
    os.setresuid(entry.pw_uid, entry.pw_uid, entry.pw_uid)


def main() -> None:
    user, socket, streams, paths = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
    # What the client would load lazily, loaded while we may still read the checkout.
    grpc.insecure_channel("unix:/nonexistent").close()
    np.unique(np.isin(np.arange(2), [1]))
    drop_to(user)
    client = Client(socket, stall_timeout=600)
    sizes = {p: os.stat(p).st_size for p in paths}
    started = time.monotonic()
    tickets = []
    for i in range(streams):
        path = paths[i % len(paths)]
        spans = [TensorSpans(f"{path}#{i}", path, 0, sizes[path], sizes[path], 1)]
        tickets.append(client.request(spans, rank=i, job=f"{user}-load"))
    for ticket in tickets:
        ticket.wait()
    seconds = time.monotonic() - started
    result = {
        "seconds": seconds,
        "ready": sum(t.progress.ready for t in tickets),
        "groups": sum(t.progress.groups for t in tickets),
    }
    for ticket in tickets:
        ticket.cancel()
    client.close()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
