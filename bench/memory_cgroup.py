"""A memory cgroup for one node's processes: the low-memory scenario of bench_end_to_end.

The node's ranks, the daemon (or a peer's warmer, which runs in the ranks) and so the page
cache they fill are charged to one cgroup, created as a child of the bench's own memory
cgroup: cgroup v1's memory controller (``memory.limit_in_bytes``), else v2's
(``memory.max``; the parent must be able to hand the memory controller down). A process
joins it before it execs (``join_command``), or the bench joins it for the moment it
forks a process that has no such hook (``joined``): a child starts in its parent's cgroup.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

V1_LIMIT, V2_LIMIT = "memory.limit_in_bytes", "memory.max"


@dataclass
class MemoryCgroup:
    directory: Path
    version: int  # 1 or 2
    home: Path  # the cgroup the bench itself was in

    @property
    def procs(self) -> Path:
        return self.directory / "cgroup.procs"

    def set_limit(self, limit: int) -> int:
        """Set the memory limit (bytes); the limit the kernel keeps (v1 rounds to pages)."""
        name = V1_LIMIT if self.version == 1 else V2_LIMIT
        (self.directory / name).write_text(str(limit))
        return int((self.directory / name).read_text())

    def limit(self) -> int | None:
        text = (self.directory / (V1_LIMIT if self.version == 1 else V2_LIMIT)).read_text()
        return None if text.strip() == "max" or int(text) >= 2**60 else int(text)

    def reset_peak(self) -> None:
        """Start the peak usage afresh (v1; v2 kernels from 6.12 on accept a write too)."""
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        with contextlib.suppress(OSError):
            (self.directory / name).write_text("0")

    def peak(self) -> int:
        """Peak usage (page cache included) since the last reset_peak."""
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        try:
            return int((self.directory / name).read_text())
        except OSError:
            return 0

    def oom_kills(self) -> int:
        """Processes the kernel killed for this cgroup's limit so far (0 where not told)."""
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        try:
            for line in (self.directory / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except OSError:
            pass
        return 0

    def holds(self, pid: int) -> bool:
        """Whether process ``pid`` is in this cgroup."""
        return str(pid) in self.procs.read_text().split()

    def join_command(self, argv: list[str]) -> list[str]:
        """``argv``, run by a shell that first moves itself into this cgroup."""
        return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.procs), *argv]

    @contextlib.contextmanager
    def joined(self) -> Iterator[None]:
        """The bench itself in this cgroup for the block (what it forks meanwhile starts
        there), then back home. Memory it allocates meanwhile stays charged here."""
        (self.procs).write_text(str(os.getpid()))
        try:
            yield
        finally:
            (self.home / "cgroup.procs").write_text(str(os.getpid()))

    def remove(self) -> None:
        """Remove the cgroup (its processes must have ended)."""
        with contextlib.suppress(OSError):
            self.directory.rmdir()


def anonymous_memory(pid: int | str = "self") -> int:
    """A process's resident anonymous memory (RssAnon), in bytes (0 once it has ended)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _mount_points() -> dict[str, Path]:
    """Where cgroup v1's memory controller and the v2 hierarchy are mounted."""
    found = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        separator = fields.index("-")
        fstype, options = fields[separator + 1], fields[separator + 3].split(",")
        if fstype == "cgroup" and "memory" in options:
            found["v1"] = Path(fields[4])
        elif fstype == "cgroup2":
            found["v2"] = Path(fields[4])
    return found


def _own_paths() -> dict[str, str]:
    """This process's cgroup path in the v1 memory hierarchy and in v2's."""
    paths = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            paths["v2"] = path.lstrip("/")
        elif "memory" in controllers.split(","):
            paths["v1"] = path.lstrip("/")
    return paths


def _create_v1(mount: Path, own: str, name: str) -> MemoryCgroup:
    home = mount / own
    directory = home / name
    directory.mkdir()
    return MemoryCgroup(directory, 1, home)


def _create_v2(mount: Path, own: str, name: str) -> MemoryCgroup:
    home = mount / own
    if "memory" not in (home / "cgroup.controllers").read_text().split():
        raise OSError(f"{home}: the memory controller is not available to this cgroup")
    # A child gets the controller only where its parent hands it down (subtree_control);
    # v2 refuses that while the parent holds processes, unless it is the root.
    if "memory" not in (home / "cgroup.subtree_control").read_text().split():
        (home / "cgroup.subtree_control").write_text("+memory")
    directory = home / name
    directory.mkdir()
    return MemoryCgroup(directory, 2, home)


def create_memory_cgroup(name: str) -> MemoryCgroup | str:
    """A new memory cgroup beside the bench (no limit yet), or why none can be made here."""
    mounts, own = _mount_points(), _own_paths()
    reasons = []
    for version, create in (("v1", _create_v1), ("v2", _create_v2)):
        if version not in mounts or version not in own:
            reasons.append(f"cgroup {version}: no memory hierarchy for this process")
            continue
        try:
            cgroup = create(mounts[version], own[version], name)
            cgroup.set_limit(2**62)  # writable: else the limit could not be set later
            return cgroup
        except OSError as error:
            reasons.append(f"cgroup {version}: {error}")
            with contextlib.suppress(OSError):
                (mounts[version] / own[version] / name).rmdir()
    return "; ".join(reasons)
