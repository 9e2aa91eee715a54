"""Start a daemon, give it streams and reads in flight, SIGTERM it; N times. Counts the
stops whose exit status was not 0 (a clean stop must exit 0, or systemd records a crash).

    .venv/bin/python scripts/stop_repeatedly.py [--times 40]

Before the daemon left without the interpreter's teardown, 5 of 40 stops here ended in
SIGABRT ("terminate called without an active exception", from grpc's threads during
finalization); 0 of 40 after. The test suite runs 15 (test_daemon.py).
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import time

from spanwarm.client import Client, TensorSpans
from spanwarm.testing.spawn import spawn_daemon

MiB = 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--times", type=int, default=40)
    args = parser.parse_args()
    logging.getLogger("spanwarm.client").setLevel(logging.ERROR)  # every stop cuts streams
    with tempfile.TemporaryDirectory() as directory:
        sparse = os.path.join(directory, "sparse")
        with open(sparse, "wb") as f:
            f.truncate(64 * 2**30)
        failed = 0
        for _ in range(args.times):
            flags = ("--log-level", "warning", "--throttle", "64MiB", "--drain-seconds", "0")
            log = open(os.path.join(directory, "daemon.log"), "w+b")  # noqa: SIM115
            env = {"PYTHONFAULTHANDLER": "1"}  # an abort prints every thread's stack
            with spawn_daemon(*flags, stderr=log, env=env) as daemon:
                clients = [Client(daemon.socket, read_yourself=False) for _ in range(8)]
                for rank, client in enumerate(clients):
                    spans = [
                        TensorSpans(f"t{i}", sparse, (i * 8 + rank) * 8 * MiB, 4096, 4096, 1)
                        for i in range(500)
                    ]
                    client.request(spans, rank=rank)
                time.sleep(0.3)
                for client in clients:  # the ranks go away, and the node stops meanwhile
                    client.close()
                status = daemon.stop()
            log.seek(0)
            err = log.read().decode(errors="replace")
            log.close()
            if status != 0:
                failed += 1
                print(f"exit status {status}:\n{err}")
        print(f"{failed} of {args.times} stops did not exit 0")


if __name__ == "__main__":
    main()
