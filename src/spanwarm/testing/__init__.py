"""Test support that the tests and the benchmarks share, as public modules:

- :mod:`spanwarm.testing.spawn`: a daemon in a child process on a temporary socket, waited
  for until it serves, stopped and reaped after.
- :mod:`spanwarm.testing.slowfs`: an emulated storage mount (FUSE) with the costs of a
  network file system (per-request latency, per-stream and total bandwidth), fault and
  hang knobs, and counters of what was read (``python -m spanwarm.testing.slowfs``).

Nothing in the daemon or the client imports them.
"""
