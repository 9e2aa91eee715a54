"""How much page cache the daemon may keep warmed ahead of consumption.

The default comes from what the node can really give: ``MemAvailable``, and inside a
container the cgroup's limit minus its working set (usage less inactive file pages,
as the kubelet counts it), cgroup v2 or v1, whichever is tighter. The page cache the
daemon warms is charged to its own cgroup, so a budget above the cgroup's room would
only make the kernel reclaim what was just warmed. A share is derived again every second:
the ranks' own memory grows while they load (in a pod, in the daemon's cgroup), and a
budget taken at the daemon's start would then exceed the room left.
"""

from __future__ import annotations

from pathlib import Path

from spanwarm.units import parse_size

__all__ = [
    "DEFAULT_SHARE",
    "available_memory",
    "cgroup_room",
    "follows_memory",
    "parse_budget",
]

DEFAULT_SHARE = 0.5  # of what is available: the job needs memory too while it loads
_UNLIMITED = 2**60


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return None if text == "max" else int(text)


def _stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            fields = line.split()
            if len(fields) >= 2 and fields[0] == key:
                return int(fields[1])
    except OSError:
        pass
    return 0


def cgroup_room(
    root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")
) -> int | None:
    """Bytes this process's memory cgroup can still take (limit - working set), or None."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    rooms = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        relative = path.lstrip("/")
        if controllers == "":  # cgroup v2
            directory = root / relative
            limit = _read_int(directory / "memory.max")
            usage = _read_int(directory / "memory.current")
            inactive = _stat(directory / "memory.stat", "inactive_file")
        elif "memory" in controllers.split(","):  # cgroup v1
            directory = root / "memory" / relative
            limit = _read_int(directory / "memory.limit_in_bytes")
            usage = _read_int(directory / "memory.usage_in_bytes")
            inactive = _stat(directory / "memory.stat", "total_inactive_file")
        else:
            continue
        if limit is not None and limit < _UNLIMITED and usage is not None:
            rooms.append(max(0, limit - max(0, usage - inactive)))
    return min(rooms) if rooms else None


def available_memory(
    meminfo: Path = Path("/proc/meminfo"),
    cgroup_root: Path = Path("/sys/fs/cgroup"),
    proc_cgroup: Path = Path("/proc/self/cgroup"),
) -> int:
    """What the node can really give: MemAvailable, or the cgroup's room if tighter."""
    available = _stat(meminfo, "MemAvailable:") * 1024
    room = cgroup_room(cgroup_root, proc_cgroup)
    return min(available, room) if room is not None else available


def follows_memory(text: str | None) -> bool:
    """Whether a budget setting is a share of what the node can give (the default, or a
    percentage), to be derived again as that changes, rather than a fixed size."""
    return text is None or text.strip().endswith("%")


def parse_budget(text: str | None, available: int) -> int:
    """``"8GiB"``, ``"25%"`` (of what is available), or None for the default share."""
    if text is None:
        return int(available * DEFAULT_SHARE)
    text = text.strip()
    if text.endswith("%"):
        share = float(text[:-1])
        if not 0 < share <= 100:
            raise ValueError(f"{text!r}: a percentage must be in (0, 100]")
        return int(available * share / 100)
    return parse_size(text)
