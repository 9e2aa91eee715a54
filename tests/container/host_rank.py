"""A rank process on the host, as a job's user, against the daemon in the container.

    python -m tests.container.host_rank UID GID GROUPS JSON_ARGS   -> one JSON object

Starts as root, imports what it will use, then drops to ``UID``:``GID`` with the
supplementary ``GROUPS`` (comma-separated, e.g. the socket's group 10001) for good, as
``tests/integration/as_user.py`` does, and requests its spans through the project's
Client: one tensor per ``[path, offset, length]``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from spanwarm.client import Client, TensorSpans
from tests.integration.as_user import load_everything


def main() -> None:
    uid, gid, groups, raw = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    args: dict[str, Any] = json.loads(raw)
    load_everything()
    os.setgroups([int(g) for g in groups.split(",") if g])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    if os.geteuid() != uid or os.getuid() != uid:
        raise SystemExit("could not drop privileges")
    spans = [
        TensorSpans(f"t{i}", path, offset, length, length, 1)
        for i, (path, offset, length) in enumerate(args["tensors"])
    ]
    client = Client(args["socket"], stall_timeout=20, read_yourself=False)  # the daemon's work
    start = time.monotonic()
    ticket = client.request(spans, rank=0, job="host-job")
    finished = ticket.wait(timeout=args.get("timeout", 30))
    elapsed = time.monotonic() - start
    progress = ticket.progress
    ticket.cancel()
    client.close()
    out = {
        "finished": finished,
        "ready": progress.ready,
        "groups": progress.groups,
        "failures": ticket.failures,
        "seconds": elapsed,
    }
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
