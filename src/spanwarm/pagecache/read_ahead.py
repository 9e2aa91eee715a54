"""How many bytes one ``POSIX_FADV_WILLNEED`` reads on a device.

The kernel cuts a ``WILLNEED`` (``force_page_cache_ra``) to ``max(io_pages, ra_pages)``
of the file's backing device: 8 MiB on this VM's disk, 128 KiB on a FUSE mount by default.
A range hinted in one call therefore has only its first window read; where the pages that
follow are then faulted in under ``MADV_RANDOM`` (the daemon's populate), each of them
would be read on its own, a page at a time. Hints of longer ranges go in pieces of this.
"""

from __future__ import annotations

import functools
import os

__all__ = ["DEFAULT_WINDOW", "hint_window"]

# The kernel's default read-ahead window (VM_READAHEAD_PAGES) and a backing device's
# default io_pages: what a device that names neither in sysfs gets.
DEFAULT_WINDOW = 128 * 2**10


@functools.lru_cache(maxsize=256)
def hint_window(st_dev: int) -> int:
    """The most one ``WILLNEED`` reads on the device ``st_dev`` names, in bytes; never more
    than the kernel's cut (a larger guess would leave pages to be read singly), possibly
    less where sysfs does not say (more calls, nothing read differently)."""
    name = f"{os.major(st_dev)}:{os.minor(st_dev)}"
    block = f"/sys/dev/block/{name}"
    if os.path.isdir(block):
        # A partition's queue is its disk's, one level up; both name their window in KiB.
        queue = block + "/queue" if os.path.isdir(block + "/queue") else block + "/../queue"
        kib = [_kib(f"{queue}/read_ahead_kb"), _kib(f"{queue}/max_sectors_kb")]
        return max([k * 2**10 for k in kib if k is not None], default=DEFAULT_WINDOW)
    # FUSE, NFS and other devices without a queue: their backing device's read-ahead;
    # their io_pages is the default, unless the file system sets more (NFS: its rsize).
    kib_ra = _kib(f"/sys/class/bdi/{name}/read_ahead_kb")
    return max(DEFAULT_WINDOW, (kib_ra or 0) * 2**10)


def _kib(path: str) -> int | None:
    try:
        with open(path) as f:
            value = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return value if value > 0 else None
