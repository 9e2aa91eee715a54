"""What the daemon learns of each mount: one stream's throughput, and its seek cost.

Throughput comes from the daemon's own reads.

Every piece the daemon reads cold (nothing of it resident before) is a sample: its bytes
and the seconds the storage took (the warm engine's I/O time, without any throttle). Per
mount, the samples' bytes over their seconds, weighted toward recent ones (exponential
decay by bytes, half-life ``HALF_LIFE_BYTES``), is the throughput of one stream of the
daemon's piece size there: latency included, which is what a rank's own read of a tensor
would also pay.

A rank uses it to decide whether waiting is worth it (:meth:`Ticket.wait_for_read`): a
tensor that is not warm after as long as the rank would take to read it cold itself is
read by the rank. On fast local storage that means ranks never queue behind the daemon;
on a slow mount, where one stream is what the daemon's many in flight beat, they wait.

Mounts are named by what ``/proc/self/mountinfo`` says of their device (file system
type, source and mount point, e.g. ``nfs4 filer:/ckpt /mnt/ckpt``), not by ``st_dev``,
whose numbers a remount or a reboot hands out again: that name is what is kept across
restarts, in ``devices.json`` in the daemon's state directory (written atomically; a file
that does not parse is ignored with a warning, never trusted in part).

The figure is per stream while the daemon runs its workers side by side, so on storage
that serves few requests at a time it is far below what one lone reader gets (on this
machine's disk 75-85 MB/s against 700 MB/s): ranks would wait up to ten times longer than
reading the tensor themselves takes. The same samples do not give a seek cost either:
with several reads in flight their fixed cost is mostly queueing (fitted on this
machine's disk: 1 MiB, where ``spanwarm calibrate`` measures 28 KiB). Both are measured
apart, once per mount, by a probe of its own on an idle node
(:mod:`spanwarm.daemon.seek_probe`): the seek cost, and the rate of one lone stream.
Once a mount has been probed, the rate a rank's waits are bounded by is the higher of
the daemon's figure and what a lone stream gets in requests of ``RANK_READ_BYTES``, each
paying one seek: ``lone x R / (R + seek cost)``. A rank reading a tensor itself is one
lone stream (where the daemon reads the same pages meanwhile, the page cache shares
them), but it reads in the loader's requests or the mapping's readahead, a MiB or less,
each with the mount's latency: on a local disk that is about 650 MB/s, on the emulated
cross-region mount (50 ms per request) 18 MB/s, below the daemon's figure, which then
stays. The probe's raw rate alone, with no latency, made ranks there stop waiting for
half their tensors and read them one slow request at a time (measured: 36 of 75 waits).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any

from spanwarm.endpoint import unsafe_directory
from spanwarm.planning.seek_cost import MAX_SEEK_COST

__all__ = [
    "HALF_LIFE_BYTES",
    "MIN_SAMPLE_BYTES",
    "RANK_READ_BYTES",
    "StreamThroughput",
    "mount_name",
]

logger = logging.getLogger("spanwarm.daemon")

HALF_LIFE_BYTES = 1 << 30  # samples older by a GiB of reads count half
MIN_SAMPLE_BYTES = 64 << 10  # smaller reads are all latency: they would say little
_MIN_BYTES = 8 << 20  # not known until this much has been read cold on the mount
_STATE_FILE = "devices.json"
_MAX_STATE_BYTES = 1 << 20
_MAX_MOUNTS = 1024  # a state file names at most this many mounts (the most sampled)
_MAX_RATE = 1e12  # bytes per second: past it, a figure is not believed
# What one request of a rank's own read brings (a loader's read, the mapping's readahead):
# the probe's lone stream pays the mount's latency once per this many bytes.
RANK_READ_BYTES = 1 << 20
# A probe's lone stream below this share of one of the daemon's own streams was disturbed
# (the margin keeps a mount whose lone and shared streams get about the same from being
# probed again after every load that nudges the daemon's figure up).
BELOW_OWN_SHARE = 0.8


def mount_name(device: int, mountinfo: str = "/proc/self/mountinfo") -> str:
    """``"<fstype> <source> <mount point>"`` of the mount whose device is ``device`` (the
    first such line: a bind mount repeats its device), or ``"dev MAJ:MIN"`` when
    mountinfo does not name it. Two mounts of one source (say, one NFS export mounted
    with different options) stay apart by their mount points."""
    wanted = f"{os.major(device)}:{os.minor(device)}"
    try:
        with open(mountinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 4 and fields[2] == wanted and "-" in fields:
                    rest = fields[fields.index("-") + 1 :]
                    if len(rest) >= 2:
                        return f"{rest[0]} {rest[1]} {fields[4]}"
    except OSError:
        pass
    return f"dev {wanted}"


@dataclass
class _Mount:
    weighted_bytes: float = 0.0
    weighted_seconds: float = 0.0
    total_bytes: int = 0
    seek_cost: int = 0  # bytes, from a probe (0: not measured yet)
    seek_probed_at: float = 0.0  # when, in seconds since the epoch
    lone_bytes_per_s: float = 0.0  # one stream on an idle node, from the probe (0: unknown)

    def learned_bytes_per_s(self) -> float:
        """The daemon's own figure: one of its streams while its workers read side by side
        (0.0 until enough is read)."""
        if self.total_bytes >= _MIN_BYTES and self.weighted_seconds > 0:
            return self.weighted_bytes / self.weighted_seconds
        return 0.0

    def below_own_streams(self, lone_bytes_per_s: float) -> bool:
        """A lone stream this slow cannot be right: one of the daemon's own streams, which
        share the mount with the other workers', got more (``BELOW_OWN_SHARE`` of it)."""
        return lone_bytes_per_s < BELOW_OWN_SHARE * self.learned_bytes_per_s()

    def probe_disturbed(self) -> bool:
        """The probe's lone stream is below the daemon's own streams on the mount:
        something else read the storage while it ran (:mod:`.seek_probe` probes again)."""
        return bool(self.seek_cost) and self.below_own_streams(self.lone_bytes_per_s)

    def bytes_per_s(self, use_lone: bool = True) -> float:
        learned = self.learned_bytes_per_s()
        rate = learned
        if self.seek_cost and use_lone:  # one figure from one probe, or neither
            lone = self.lone_bytes_per_s * RANK_READ_BYTES / (RANK_READ_BYTES + self.seek_cost)
            rate = max(learned, lone)
        # No storage streams a TB/s: anything faster is a damaged record, and would make
        # every rank stop waiting at once.
        return rate if math.isfinite(rate) and rate <= _MAX_RATE else 0.0


_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FILE = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK


def state_directory(path: str, *, create: bool) -> int:
    """A descriptor of the state directory ``path`` (made 0700 if ``create`` and missing),
    opened without following a symlink in its place, and only where no other user could
    change what it holds: the daemon's own, writable by nobody else, in directories
    nobody else can swap entries of (:func:`~spanwarm.endpoint.unsafe_directory`). A root
    daemon writes there: a symlink another user planted must not lead it elsewhere."""
    parent = os.path.dirname(os.path.abspath(path))
    if create:
        os.makedirs(parent, mode=0o755, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
    reason = unsafe_directory(parent)
    if reason is not None:
        raise PermissionError(errno.EPERM, f"not a safe place for state: {reason}")
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        os.close(fd)
        raise PermissionError(
            errno.EPERM, f"{path} is not the daemon's own directory, or others may write in it"
        )
    return fd


class StreamThroughput:
    """Per mount: bytes per second of one stream of cold reads (thread-safe), kept in
    ``state_dir`` (None: not kept)."""

    def __init__(self, state_dir: str | None = None, *, use_lone: bool = True) -> None:
        self._mounts: dict[str, _Mount] = {}
        # False with --seek-cost: nothing is probed, and a lone rate kept from an earlier
        # probe (priced at that probe's seek cost) is not used either.
        self.use_lone = use_lone
        self._names: dict[int, str] = {}  # st_dev -> mount name, as mountinfo said
        self._lock = threading.Lock()
        self._dirty = False
        self.state_dir = state_dir
        if state_dir:
            self._load(state_dir)

    def name(self, device: int) -> str:
        with self._lock:
            known = self._names.get(device)
        if known is None:
            known = mount_name(device)
            with self._lock:
                self._names[device] = known
        return known

    def record(self, device: int, nbytes: int, seconds: float) -> None:
        """One cold read of ``nbytes`` that took ``seconds`` on ``device``."""
        if nbytes < MIN_SAMPLE_BYTES or not seconds > 0:
            return
        name = self.name(device)
        with self._lock:
            m = self._mounts.setdefault(name, _Mount())
            keep = 0.5 ** (nbytes / HALF_LIFE_BYTES)
            m.weighted_bytes = m.weighted_bytes * keep + nbytes
            m.weighted_seconds = m.weighted_seconds * keep + seconds
            m.total_bytes += nbytes
            self._dirty = True

    def bytes_per_s(self, device: int) -> float:
        """One stream's throughput on ``device``'s mount: the higher of the daemon's
        learned one and the probe's lone stream in requests of ``RANK_READ_BYTES``, each
        paying a seek; 0.0 while neither is known."""
        name = self.name(device)
        with self._lock:
            m = self._mounts.get(name)
            return 0.0 if m is None else m.bytes_per_s(self.use_lone)

    def seek_cost(self, device: int) -> int:
        """The seek cost probed on ``device``'s mount in bytes; 0 while not measured."""
        name = self.name(device)
        with self._lock:
            m = self._mounts.get(name)
            return 0 if m is None else m.seek_cost

    def seek_cost_age(self, mount: str) -> float | None:
        """Seconds since ``mount`` was probed (None: never)."""
        with self._lock:
            m = self._mounts.get(mount)
            if m is None or not m.seek_cost:
                return None
            return max(0.0, time.time() - m.seek_probed_at)

    def learned_bytes_per_s(self, mount: str) -> float:
        """The daemon's own one-stream figure on ``mount``, without the probe's (0.0: not
        known yet)."""
        with self._lock:
            m = self._mounts.get(mount)
            return 0.0 if m is None else m.learned_bytes_per_s()

    def below_own_streams(self, mount: str, lone_bytes_per_s: float) -> bool:
        """Whether a lone stream of ``lone_bytes_per_s`` is below the daemon's own streams
        on ``mount`` (see ``BELOW_OWN_SHARE``)."""
        with self._lock:
            m = self._mounts.get(mount)
            return m is not None and m.below_own_streams(lone_bytes_per_s)

    def probe_disturbed(self, mount: str) -> bool:
        """Whether the figure kept for ``mount`` came from a probe that something else's
        reads slowed down: its lone stream is below one of the daemon's own streams."""
        with self._lock:
            m = self._mounts.get(mount)
            return m is not None and m.probe_disturbed()

    def learn_seek_cost(self, device: int, seek_cost: int, lone_bytes_per_s: float) -> None:
        """A probe measured ``seek_cost`` bytes and one lone stream's rate on ``device``'s
        mount now (a seek cost of at least 1: a measured zero is kept as one byte, so that
        it reads as known; a rate that is not a number a storage could stream is not kept)."""
        name = self.name(device)
        with self._lock:
            m = self._mounts.setdefault(name, _Mount())
            m.seek_cost = min(max(1, int(seek_cost)), MAX_SEEK_COST)
            m.seek_probed_at = time.time()
            ok = math.isfinite(lone_bytes_per_s) and 0 < lone_bytes_per_s <= _MAX_RATE
            m.lone_bytes_per_s = float(lone_bytes_per_s) if ok else 0.0
            self._dirty = True

    def snapshot(self) -> list[tuple[str, float, int, int]]:
        """(mount, bytes per second or 0.0 while unknown, bytes sampled, seek cost or 0
        while not measured), most sampled first."""
        with self._lock:
            rows = [
                (n, m.bytes_per_s(self.use_lone), m.total_bytes, m.seek_cost)
                for n, m in self._mounts.items()
            ]
        return sorted(rows, key=lambda row: -row[2])

    # -- kept across restarts ------------------------------------------------------------

    def save(self) -> None:
        """Write what was learned, if anything changed (atomically: a crash leaves the old
        file or the new one)."""
        if not self.state_dir:
            return
        with self._lock:
            if not self._dirty:
                return
            self._dirty = False
            mounts = sorted(self._mounts.items(), key=lambda kv: -kv[1].total_bytes)
            document = {
                "version": 1,
                "mounts": {
                    name: {
                        "weighted_bytes": m.weighted_bytes,
                        "weighted_seconds": m.weighted_seconds,
                        "total_bytes": m.total_bytes,
                        "seek_cost_bytes": m.seek_cost,
                        "seek_probed_at": m.seek_probed_at,
                        "lone_bytes_per_s": m.lone_bytes_per_s,
                    }
                    for name, m in mounts[:_MAX_MOUNTS]
                },
            }
        try:
            directory = state_directory(self.state_dir, create=True)
        except OSError as exc:
            logger.warning("cannot keep learned throughput in %s: %s", self.state_dir, exc)
            return
        tmp = f".devices-{secrets.token_hex(8)}"
        try:
            fd = os.open(tmp, _NEW_FILE, 0o600, dir_fd=directory)
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    json.dump(document, f)
                os.replace(tmp, _STATE_FILE, src_dir_fd=directory, dst_dir_fd=directory)
            except BaseException:
                os.unlink(tmp, dir_fd=directory)
                raise
        except OSError as exc:
            logger.warning("cannot keep learned throughput in %s: %s", self.state_dir, exc)
        finally:
            os.close(directory)

    def _load(self, state_dir: str) -> None:
        path = os.path.join(state_dir, _STATE_FILE)
        try:
            directory = state_directory(state_dir, create=False)
        except FileNotFoundError:
            return
        except OSError as exc:
            logger.warning("ignoring %s: %s", path, exc)
            return
        try:
            fd = os.open(_STATE_FILE, _READ_FILE, dir_fd=directory)
        except FileNotFoundError:
            return
        except OSError as exc:
            logger.warning("ignoring %s: %s", path, exc)
            return
        finally:
            os.close(directory)
        try:
            with os.fdopen(fd, "rb") as f:
                st = os.fstat(f.fileno())
                if st.st_uid != os.geteuid() or st.st_mode & 0o022:
                    raise ValueError("not the daemon's own file, or writable by others")
                raw = f.read(_MAX_STATE_BYTES + 1)
            if len(raw) > _MAX_STATE_BYTES:
                raise ValueError(f"larger than {_MAX_STATE_BYTES} bytes")
            self._mounts = _parse(json.loads(raw))
        except Exception as exc:  # whatever is in it: start over, never fail to start
            logger.warning("ignoring %s (learned throughput starts over): %s", path, exc)
            self._mounts = {}


def _parse(document: Any) -> dict[str, _Mount]:
    if not isinstance(document, dict) or document.get("version") != 1:
        raise ValueError("not a version 1 document")
    mounts = document["mounts"]
    if not isinstance(mounts, dict):
        raise ValueError("not a version 1 document of mounts")
    out: dict[str, _Mount] = {}
    for name, entry in list(mounts.items())[:_MAX_MOUNTS]:
        values = (entry["weighted_bytes"], entry["weighted_seconds"], entry["total_bytes"])
        if not isinstance(name, str) or not all(
            isinstance(v, int | float) and not isinstance(v, bool) and 0 <= v < 2**63
            for v in values
        ):
            raise ValueError(f"mount {name!r}: not three numbers from 0 to 2**63")
        # All absent in files from before the probe, the rate in files from its first
        # versions.
        seek_cost, probed_at = entry.get("seek_cost_bytes", 0), entry.get("seek_probed_at", 0)
        lone = entry.get("lone_bytes_per_s", 0.0)
        if type(seek_cost) is not int or not 0 <= seek_cost <= MAX_SEEK_COST:
            raise ValueError(f"mount {name!r}: seek_cost_bytes is not a byte count")
        if type(probed_at) not in (int, float) or not 0 <= probed_at < 2**40:
            raise ValueError(f"mount {name!r}: seek_probed_at is not a time")
        if type(lone) not in (int, float) or not 0 <= lone <= _MAX_RATE:
            raise ValueError(f"mount {name!r}: lone_bytes_per_s is not a rate")
        out[name] = _Mount(
            float(values[0]),
            float(values[1]),
            int(values[2]),
            seek_cost,
            float(probed_at),
            float(lone),
        )
    return out
