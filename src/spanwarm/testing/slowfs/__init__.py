"""An emulated network mount for benchmarks: a read-only FUSE passthrough that adds latency
and caps bandwidth the way a network filesystem with server-side streaming does.

Cost model, per read request the kernel sends (after the page cache missed):

- Latency: each open file handle has a stream, positioned where its previous read request
  ended. A request that continues the stream (its offset is within ``STREAM_TOLERANCE``,
  2 MiB, of that position either way: the kernel keeps several readahead requests in
  flight and they may arrive slightly out of order) pays no latency; any other request is
  a seek and pays ``latency_s`` before its bytes start to flow. The first request on a
  handle is a seek. This is what the seed measured on its mount as "50 ms per seek".
- Bandwidth: a request's bytes are reserved on its handle's clock
  (``size / stream_bytes_per_s``) and on one clock for the whole mount
  (``size / total_bytes_per_s``); each clock starts the reservation at the later of the
  request's arrival (plus its latency) and the clock's next free time, so idle time earns
  no credit. The request is answered when both reservations have ended.

Requests sleep with ``time.sleep`` (which releases the GIL) on a multithreaded libfuse
loop, so many are in flight at once. The mount uses ``kernel_cache``: cached pages survive
close and reopen, as on a real mount, and ``posix_fadvise``/``mincore`` (hence
:mod:`spanwarm.pagecache.residency`) work on its files.

Faults and hangs, for tests of error handling and shutdown (both match read *requests*, as
the kernel sends them, against a byte range of one file named relative to the mount root):

- :class:`Fault`: a request that overlaps ``[start, start + length)`` fails with an errno
  (EIO by default) at once, without paying the cost model or moving the stream. The kernel
  caches none of a failed request's pages, so reading them again fails again; requests
  that do not overlap the range succeed. Faults act on whole pages: the kernel reads
  pages, never parts of them. It also batches pages (its readahead window) in one request,
  but when such a request fails it retries the pages the reader needs one request each,
  so a ``read`` that starts before the range returns the bytes up to the range's first
  page (a short read), and a page-sized ``pread`` of any other page succeeds, before or
  after the failure. ``POSIX_FADV_RANDOM`` on the reader's descriptor turns readahead off:
  then each read sends just the pages it covers.
- :class:`Hang`: a request that overlaps the range (by default the whole file) sleeps
  ``seconds`` before it is served (then as usual: costs, and any fault). The sleep gives up
  with EIO as soon as the server is told to stop (SIGTERM, or :func:`mount`'s unmount), so
  a hung read never holds up unmounting for long.

Counters (bytes served, read requests, seeks, failed and hung requests; in total and per
file, plus a histogram of request sizes and the most requests seen in flight) are served as
JSON by the virtual file ``.slowfs-stats`` at the mount root. It is opened ``direct_io`` so
every read sees fresh numbers, and reading it is not counted. Bytes, requests and seeks
count served requests only; ``faults`` counts requests failed by a Fault (one failing read
may send two: the kernel retries a failed readahead request before it gives up), ``hangs``
requests delayed by a Hang.

    with mount(src, mnt, "cross-region", latency_s=0.02) as fs:
        fs.path("model.safetensors").read_bytes()
        fs.stats()["bytes"]

    with mount(src, mnt, faults=[Fault("model.safetensors", 8192, 4096)]) as fs:
        os.pread(fd, 4096, 8192)  # OSError: [Errno 5] EIO; pages 0, 1 and 3 read fine

With a trace file (``mount(..., trace=PATH)``, ``--trace PATH``), every served read request
is also written there as one JSON line: when it arrived and when it was answered
(monotonic seconds, comparable with the caller's ``time.monotonic()``), the thread id
of the process that sent it as the kernel reports it (for read-ahead, whoever started
it) and that thread's process (``pid``, -1 once it has exited), the file, the open
handle, the offset and the size. Which process of a load sends which requests, in what
order: the single-page requests a rank's hints sent for a column slice were found so,
and what each rank of a vLLM server reads (tests/vllm).

The filesystem itself runs in a child process (``python -m spanwarm.testing.slowfs``), so that its
threads and sleeps never compete with the benchmark's own interpreter.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import functools
import json
import os
import posixpath
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

__all__ = [
    "PRESETS",
    "STATS_NAME",
    "STREAM_TOLERANCE",
    "Fault",
    "Hang",
    "Preset",
    "SlowFS",
    "SlowFSOperations",
    "fuse_available",
    "mount",
    "resolve_preset",
    "serve",
]

STATS_NAME = ".slowfs-stats"
STREAM_TOLERANCE = 2 << 20
REPO_ROOT = Path(__file__).resolve().parents[2]

# Kernel-side limits raised at mount: FUSE's default of 12 background (readahead) requests
# for the whole mount would cap 8 concurrent streams, and libfuse's 10 worker threads the
# requests a slow mount holds in flight.
_MAX_BACKGROUND = 128
_MAX_THREADS = 128
_MAX_READ = 1 << 20
_MOUNT_TIMEOUT_S = 10.0
_UNMOUNT_ATTEMPTS = 5
_HANG_POLL_S = 0.05  # how often a hung read checks whether the server is stopping

if TYPE_CHECKING:
    _Operations = object
else:
    try:
        from mfusepy import Operations as _Operations
    except (ImportError, OSError):  # mfusepy absent, or libfuse3 missing: see fuse_available
        _Operations = object


@dataclass(frozen=True)
class Preset:
    """Network characteristics of an emulated mount. ``None`` means no bandwidth cap."""

    name: str
    latency_s: float
    stream_bytes_per_s: float | None
    total_bytes_per_s: float | None

    def __post_init__(self) -> None:
        if self.latency_s < 0:
            raise ValueError(f"latency_s must be >= 0, got {self.latency_s}")
        for knob in ("stream_bytes_per_s", "total_bytes_per_s"):
            value = getattr(self, knob)
            if value is not None and value <= 0:
                raise ValueError(f"{knob} must be > 0 or None, got {value}")


PRESETS: dict[str, Preset] = {
    preset.name: preset
    for preset in (
        Preset("local", 0.0, None, None),
        Preset("nfs-like", 0.001, 400e6, None),
        # The seed's mount: a seek costs as much time as streaming ~12 MiB.
        Preset("cross-region", 0.050, 0.24 * 2**30, None),
    )
}

_KNOBS = ("latency_s", "stream_bytes_per_s", "total_bytes_per_s")


def resolve_preset(preset: Preset | str, **overrides: float | None) -> Preset:
    """``preset`` (a name from PRESETS, or a Preset) with some knobs overridden."""
    base = PRESETS[preset] if isinstance(preset, str) else preset
    unknown = set(overrides) - set(_KNOBS)
    if unknown:
        raise TypeError(f"unknown preset knobs {sorted(unknown)}; known: {list(_KNOBS)}")
    return dataclasses.replace(base, **overrides)  # type: ignore[arg-type]


def _check_name(name: str) -> None:
    """A file's path as the server sees it: relative to the mount root, and normalized."""
    outside = name in ("", ".", "..") or name.startswith(("/", "../"))
    if outside or "\0" in name or posixpath.normpath(name) != name:
        raise ValueError(f"name must be a normalized path inside the mount, got {name!r}")


def _parse_errno(text: str) -> int:
    """An errno given as a number (5) or a name (EIO)."""
    if text.isdigit():
        return int(text)
    code = getattr(errno, text.upper(), None)
    if not text.upper().startswith("E") or not isinstance(code, int):
        raise ValueError(f"unknown errno {text!r}")
    return code


@dataclass(frozen=True)
class Fault:
    """Read requests for ``name`` that overlap bytes ``[start, start + length)`` fail with
    ``errno`` (see the module docstring).

    ``name`` is relative to the mount root (``"sub/model.safetensors"``).
    """

    name: str
    start: int
    length: int
    errno: int = errno.EIO

    def __post_init__(self) -> None:
        _check_name(self.name)
        if self.start < 0 or self.length <= 0:
            raise ValueError(f"need start >= 0 and length > 0, got {self.start}, {self.length}")
        if self.errno <= 0:
            raise ValueError(f"errno must be > 0, got {self.errno}")

    def overlaps(self, offset: int, size: int) -> bool:
        """Whether a request for ``size`` bytes at ``offset`` touches the range."""
        return offset < self.start + self.length and self.start < offset + size

    def to_arg(self) -> str:
        """The ``--fault`` value of the server (inverse of :meth:`parse`)."""
        code = errno.errorcode.get(self.errno, str(self.errno))
        return f"{self.name}:{self.start}:{self.length}:{code}"

    @classmethod
    def parse(cls, text: str) -> Fault:
        """``NAME:START:LENGTH[:ERRNO]``; ERRNO is a number or a name such as ``ENODATA``.

        Fields are taken from the right: a NAME containing ``:`` needs the ERRNO field.
        """
        colons = text.count(":")
        if colons < 2:
            raise ValueError(f"expected NAME:START:LENGTH[:ERRNO], got {text!r}")
        if colons == 2:
            name, start, length = text.split(":")
            return cls(name, int(start), int(length))
        name, start, length, code = text.rsplit(":", 3)
        return cls(name, int(start), int(length), _parse_errno(code))


@dataclass(frozen=True)
class Hang:
    """Read requests for ``name`` that overlap bytes ``[start, start + length)`` (to the end
    of the file when ``length`` is None) sleep ``seconds`` before they are served.

    ``name`` is relative to the mount root. A request that matches several hangs sleeps
    for the longest.
    """

    name: str
    seconds: float
    start: int = 0
    length: int | None = None

    def __post_init__(self) -> None:
        _check_name(self.name)
        if not self.seconds >= 0:
            raise ValueError(f"seconds must be >= 0, got {self.seconds}")
        if self.start < 0 or (self.length is not None and self.length <= 0):
            raise ValueError(f"need start >= 0 and length > 0, got {self.start}, {self.length}")

    def overlaps(self, offset: int, size: int) -> bool:
        """Whether a request for ``size`` bytes at ``offset`` touches the range."""
        ends_after_start = offset + size > self.start
        return ends_after_start and (self.length is None or offset < self.start + self.length)

    def to_arg(self) -> str:
        """The ``--hang`` value of the server (inverse of :meth:`parse`)."""
        length = "end" if self.length is None else str(self.length)
        return f"{self.name}:{self.seconds!r}:{self.start}:{length}"

    @classmethod
    def parse(cls, text: str) -> Hang:
        """``NAME:SECONDS[:START:LENGTH]``; LENGTH ``end`` means to the end of the file.

        Fields are taken from the right: a NAME containing ``:`` needs START and LENGTH.
        """
        colons = text.count(":")
        if colons in (0, 2):
            raise ValueError(f"expected NAME:SECONDS[:START:LENGTH], got {text!r}")
        if colons == 1:
            name, seconds = text.split(":")
            return cls(name, float(seconds))
        name, seconds, start, length = text.rsplit(":", 3)
        end = length.lower() == "end"
        return cls(name, float(seconds), int(start), None if end else int(length))


@functools.cache
def _stop_probe() -> Callable[[], bool]:
    """A function that, called inside a FUSE request, tells whether the server is stopping.

    libfuse handles SIGTERM itself (it flags the session as exited) and then waits for the
    requests in progress, so a hung read must notice the flag to let the server exit.
    """
    try:
        import mfusepy

        lib = ctypes.CDLL(mfusepy._libfuse._name)  # own function objects: mfusepy's untouched
        get_context = lib.fuse_get_context
        get_session = lib.fuse_get_session
        exited = lib.fuse_session_exited
    except (ImportError, OSError, AttributeError):
        return lambda: False
    # struct fuse_context starts with its struct fuse pointer.
    get_context.restype = ctypes.POINTER(ctypes.c_void_p)
    get_context.argtypes = []
    get_session.restype = ctypes.c_void_p
    get_session.argtypes = [ctypes.c_void_p]
    exited.restype = ctypes.c_int
    exited.argtypes = [ctypes.c_void_p]

    def stopping() -> bool:
        context = get_context()
        if not context or not context[0]:
            return False  # not inside a request
        session = get_session(context[0])
        return bool(session) and bool(exited(session))

    return stopping


@dataclass(slots=True)
class _Counts:
    bytes: int = 0
    requests: int = 0
    seeks: int = 0
    faults: int = 0
    hangs: int = 0


@dataclass(slots=True)
class _Handle:
    name: str  # path relative to the mount root
    fd: int  # -1 for the stats file
    snapshot: bytes = b""  # the stats file's content, fixed at open
    stream_end: int | None = None  # where this handle's previous read request ended
    next_free: float = 0.0  # this handle's bandwidth clock


class SlowFSOperations(_Operations):
    """mfusepy operations of a read-only passthrough over ``source`` with ``preset``'s costs.

    Use with ``mfusepy.FUSE(..., raw_fi=True)``: open needs the fuse_file_info to set
    ``direct_io`` on the stats file.
    """

    use_ns = True  # nanosecond timestamps (mfusepy warns otherwise)

    def __init__(
        self,
        source: Path,
        preset: Preset,
        *,
        faults: Iterable[Fault] = (),
        hangs: Iterable[Hang] = (),
        trace: Path | None = None,
        hang_flush: Iterable[str] = (),
    ) -> None:
        self._source = source.resolve()
        self._hang_flush = frozenset(hang_flush)
        # Line-buffered, appended to under the lock: one whole line per request.
        self._trace = None if trace is None else trace.open("a", buffering=1)
        self._preset = preset
        self._faults: dict[str, list[Fault]] = {}
        for fault in faults:
            self._faults.setdefault(fault.name, []).append(fault)
        self._hangs: dict[str, list[Hang]] = {}
        for hang in hangs:
            self._hangs.setdefault(hang.name, []).append(hang)
        self._lock = threading.Lock()
        self._handles: dict[int, _Handle] = {}
        self._next_fh = 1
        self._global_next_free = 0.0
        self._totals = _Counts()
        self._files: dict[str, _Counts] = {}
        self._sizes: Counter[int] = Counter()
        self._in_flight = 0
        self._max_in_flight = 0

    def init_with_config(self, conn: Any, config: Any) -> None:
        conn.max_read = _MAX_READ  # libfuse refuses to start unless it matches the option
        conn.max_background = _MAX_BACKGROUND
        conn.congestion_threshold = _MAX_BACKGROUND * 3 // 4
        config.kernel_cache = 1

    def _backing(self, path: str) -> Path:
        return self._source / path.lstrip("/")

    def getattr(self, path: str, fh: Any = None) -> dict[str, int]:
        if path == "/" + STATS_NAME:
            now = time.time_ns()
            # Size 0 as in /proc: direct_io reads go to us whatever the size says.
            return {
                "st_mode": stat.S_IFREG | 0o444,
                "st_nlink": 1,
                "st_size": 0,
                "st_atime": now,
                "st_mtime": now,
                "st_ctime": now,
            }
        st = os.stat(self._backing(path))
        write_bits = stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH
        return {
            "st_mode": st.st_mode & ~write_bits,
            "st_nlink": st.st_nlink,
            "st_size": st.st_size,
            "st_uid": st.st_uid,
            "st_gid": st.st_gid,
            "st_blocks": st.st_blocks,
            "st_atime": st.st_atime_ns,
            "st_mtime": st.st_mtime_ns,
            "st_ctime": st.st_ctime_ns,
        }

    def readdir(self, path: str, fh: int) -> list[str]:
        names = [".", "..", *os.listdir(self._backing(path))]
        if path == "/":
            names.append(STATS_NAME)
        return names

    def access(self, path: str, amode: int) -> int:
        if amode & os.W_OK:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        if path != "/" + STATS_NAME and not os.access(self._backing(path), amode):
            raise OSError(errno.EACCES, os.strerror(errno.EACCES))
        return 0

    def statfs(self, path: str) -> dict[str, int]:
        sv = os.statvfs(self._source)
        fields = (
            "f_bsize",
            "f_frsize",
            "f_blocks",
            "f_bfree",
            "f_bavail",
            "f_files",
            "f_ffree",
            "f_favail",
            "f_namemax",
        )
        return {name: getattr(sv, name) for name in fields}

    def open(self, path: str, fi: Any) -> int:
        if fi.flags & os.O_ACCMODE != os.O_RDONLY:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        if path == "/" + STATS_NAME:
            handle = _Handle(STATS_NAME, -1, snapshot=self._stats_json())
            fi.direct_io = 1
        else:
            handle = _Handle(path.lstrip("/"), os.open(self._backing(path), os.O_RDONLY))
            fi.keep_cache = 1  # as kernel_cache does: pages survive reopening
        with self._lock:
            fh = self._next_fh
            self._next_fh += 1
            self._handles[fh] = handle
        fi.fh = fh
        return 0

    def release(self, path: str, fi: Any) -> int:
        with self._lock:
            handle = self._handles.pop(fi.fh)
        if handle.fd >= 0:
            os.close(handle.fd)
        return 0

    def read(self, path: str, size: int, offset: int, fi: Any) -> bytes:
        arrival = time.monotonic()
        handle = self._handles[fi.fh]
        if handle.fd < 0:
            return handle.snapshot[offset : offset + size]
        with self._lock:
            self._in_flight += 1
            self._max_in_flight = max(self._max_in_flight, self._in_flight)
        try:
            hang = max(
                (h.seconds for h in self._hangs.get(handle.name, ()) if h.overlaps(offset, size)),
                default=None,
            )
            if hang is not None:
                self._count(handle, "hangs")
                self._sleep_unless_stopping(hang)
                arrival = time.monotonic()
            for fault in self._faults.get(handle.name, ()):
                if fault.overlaps(offset, size):
                    self._count(handle, "faults")
                    raise OSError(fault.errno, os.strerror(fault.errno))
            data = os.pread(handle.fd, size, offset)
            with self._lock:
                done = self._charge(handle, offset, len(data), arrival)
                if self._trace is not None:
                    self._trace_request(arrival, done, fi.fh, handle.name, offset, len(data))
            delay = done - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            return data
        finally:
            with self._lock:
                self._in_flight -= 1

    def _trace_request(
        self, arrival: float, done: float, fh: int, name: str, offset: int, size: int
    ) -> None:
        """One line of the trace file (lock held)."""
        import mfusepy  # the server's module is loaded already: no cost

        assert self._trace is not None
        tid = mfusepy.fuse_get_context()[2]
        record = {"arrival": arrival, "done": done, "tid": tid, "pid": _process_of(tid)}
        record.update(file=name, handle=fh)
        self._trace.write(json.dumps({**record, "offset": offset, "size": size}) + "\n")

    def _count(self, handle: _Handle, counter: str) -> None:
        with self._lock:
            per_file = self._files.setdefault(handle.name, _Counts())
            for counts in (self._totals, per_file):
                setattr(counts, counter, getattr(counts, counter) + 1)

    @staticmethod
    def _sleep_unless_stopping(seconds: float) -> None:
        """Sleep, but fail the request with EIO as soon as the server is told to stop."""
        stopping = _stop_probe()
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            time.sleep(min(left, _HANG_POLL_S))
            if stopping():
                raise OSError(errno.EIO, "slowfs is stopping")

    def _charge(self, handle: _Handle, offset: int, size: int, arrival: float) -> float:
        """Count a request and return when it completes under the cost model (lock held)."""
        preset = self._preset
        end = handle.stream_end
        seek = end is None or abs(offset - end) > STREAM_TOLERANCE
        handle.stream_end = offset + size
        start = arrival + (preset.latency_s if seek else 0.0)
        done = start
        if preset.stream_bytes_per_s is not None:
            handle.next_free = max(start, handle.next_free) + size / preset.stream_bytes_per_s
            done = max(done, handle.next_free)
        if preset.total_bytes_per_s is not None:
            self._global_next_free = (
                max(start, self._global_next_free) + size / preset.total_bytes_per_s
            )
            done = max(done, self._global_next_free)
        self._sizes[size] += 1
        per_file = self._files.setdefault(handle.name, _Counts())
        for counts in (self._totals, per_file):
            counts.bytes += size
            counts.requests += 1
            counts.seeks += seek
        return done

    def _stats_json(self) -> bytes:
        with self._lock:
            stats = {
                "preset": dataclasses.asdict(self._preset),
                "source": str(self._source),
                **dataclasses.asdict(self._totals),
                "max_in_flight": self._max_in_flight,
                "open_handles": len(self._handles),
                "request_sizes": {str(size): n for size, n in sorted(self._sizes.items())},
                "files": {name: dataclasses.asdict(c) for name, c in sorted(self._files.items())},
            }
        return json.dumps(stats, indent=1).encode() + b"\n"


class _HangingFlushOperations(SlowFSOperations):
    """With ``hang_flush``: the server answers FLUSH, and never for those names. Without,
    no ``flush`` is served at all (the kernel then sends none, and a close after the
    server has gone does not fail)."""

    def flush(self, path: str, fi: Any) -> int:
        """Each close() of a file named in ``hang_flush`` waits for this answer: never
        given, until the server is told to stop (then EIO)."""
        if path.lstrip("/") in self._hang_flush:
            self._sleep_unless_stopping(float("inf"))
        return 0


def _process_of(tid: int) -> int:
    """The process (thread group) of thread ``tid``; -1 where it has gone."""
    try:
        with open(f"/proc/{tid}/status", "rb") as status:
            for line in status:
                if line.startswith(b"Tgid:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return -1


def serve(
    source: Path,
    mountpoint: Path,
    preset: Preset,
    *,
    faults: Iterable[Fault] = (),
    hangs: Iterable[Hang] = (),
    debug: bool = False,
    allow_other: bool = False,
    trace: Path | None = None,
    hang_flush: Iterable[str] = (),
) -> None:
    """Mount ``source`` at ``mountpoint`` and serve in the foreground until unmounted
    (``allow_other``: other users may use the mount, with the kernel checking the files'
    permissions; root only; ``trace``: a file each read request is logged to)."""
    import mfusepy  # here, not at the top: only the server needs libfuse

    mfusepy.FUSE(
        (_HangingFlushOperations if hang_flush else SlowFSOperations)(
            source, preset, faults=faults, hangs=hangs, trace=trace, hang_flush=hang_flush
        ),
        str(mountpoint),
        raw_fi=True,
        foreground=True,
        debug=debug,
        ro=True,
        kernel_cache=True,
        max_read=_MAX_READ,
        max_threads=_MAX_THREADS,
        fsname=f"slowfs:{source}",
        subtype="slowfs",
        **({"allow_other": True, "default_permissions": True} if allow_other else {}),
    )


@dataclass(frozen=True)
class SlowFS:
    """A live emulated mount, as yielded by :func:`mount`."""

    source: Path
    mountpoint: Path
    preset: Preset
    pid: int
    faults: tuple[Fault, ...] = ()
    hangs: tuple[Hang, ...] = ()

    @property
    def read_ahead_kb(self) -> int:
        """The kernel's readahead window for this mount (it caps FUSE read request sizes)."""
        return int(_bdi_file(self.mountpoint).read_text())

    def path(self, name: str | os.PathLike[str]) -> Path:
        """``name`` (relative to the source directory) inside the mount."""
        return self.mountpoint / name

    def stats(self) -> dict[str, Any]:
        """The current counters (see the module docstring)."""
        stats: dict[str, Any] = json.loads((self.mountpoint / STATS_NAME).read_bytes())
        return stats


@contextlib.contextmanager
def mount(
    source: Path,
    mountpoint: Path,
    preset: Preset | str = "local",
    *,
    faults: Iterable[Fault] = (),
    hangs: Iterable[Hang] = (),
    read_ahead_kb: int | None = None,
    timeout_s: float = _MOUNT_TIMEOUT_S,
    allow_other: bool = False,
    trace: Path | None = None,
    hang_flush: Iterable[str] = (),
    **overrides: float | None,
) -> Iterator[SlowFS]:
    """Mount ``source`` read-only at ``mountpoint`` (created if missing) in a child process.

    ``overrides`` set preset knobs (``latency_s``, ``stream_bytes_per_s``,
    ``total_bytes_per_s``). ``faults`` and ``hangs`` make reads of some byte ranges fail
    or hang (see :class:`Fault`, :class:`Hang`). ``read_ahead_kb`` replaces the kernel's
    readahead window for the mount (128 KiB by default; root only), which bounds the size
    of read requests. ``allow_other`` lets other users in (files' modes apply; root only).
    ``trace``: a file each served read request is appended to (see the module docstring).
    ``hang_flush``: names whose every close() hangs (the server never answers its FLUSH,
    as a user's own FUSE server may), until unmount. Yields once the mount is live;
    unmounts and reaps the child on exit, lazily if files inside are still open (a read
    or close hung then fails with EIO or ENOTCONN).
    """
    resolved = resolve_preset(preset, **overrides)
    faults = tuple(faults)
    hangs = tuple(hangs)
    mountpoint.mkdir(parents=True, exist_ok=True)
    if os.path.ismount(mountpoint):
        raise RuntimeError(f"{mountpoint} is already a mount point")
    cmd = [
        sys.executable,
        "-m",
        "spanwarm.testing.slowfs",
        str(source),
        str(mountpoint),
        "--preset",
        "local",
        "--name",
        resolved.name,
        "--latency",
        repr(resolved.latency_s),
        "--stream-bw",
        repr(resolved.stream_bytes_per_s),
        "--total-bw",
        repr(resolved.total_bytes_per_s),
        *(f"--fault={fault.to_arg()}" for fault in faults),
        *(f"--hang={hang.to_arg()}" for hang in hangs),
        *(["--allow-other"] if allow_other else []),
        *([f"--trace={trace.resolve()}"] if trace is not None else []),
        *(f"--hang-flush={name}" for name in hang_flush),
    ]
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(
            cmd, cwd=REPO_ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
        )
        try:
            _wait_mounted(proc, mountpoint, timeout_s, log)
            if read_ahead_kb is not None:
                _bdi_file(mountpoint).write_text(f"{read_ahead_kb}\n")
            yield SlowFS(source, mountpoint, resolved, proc.pid, faults, hangs)
        finally:
            _unmount(mountpoint, proc)


def _bdi_file(mountpoint: Path) -> Path:
    dev = os.stat(mountpoint).st_dev
    return Path(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb")


def _wait_mounted(
    proc: subprocess.Popen[bytes], mountpoint: Path, timeout_s: float, log: IO[bytes]
) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.ismount(mountpoint):
        if proc.poll() is not None or time.monotonic() > deadline:
            log.seek(0)
            output = log.read().decode(errors="replace").strip()
            state = f"exited with {proc.returncode}" if proc.returncode is not None else "hung"
            raise RuntimeError(f"slowfs at {mountpoint} {state} before mounting: {output}")
        time.sleep(0.01)


def _unmount(mountpoint: Path, proc: subprocess.Popen[bytes]) -> None:
    """Unmount (retrying while busy, then lazily) and reap the server."""
    lazy = False
    for attempt in range(_UNMOUNT_ATTEMPTS):
        if not os.path.ismount(mountpoint):
            break
        if attempt:
            time.sleep(0.05 * attempt)
        subprocess.run(["fusermount3", "-u", "-q", str(mountpoint)], check=False)
    else:
        subprocess.run(["fusermount3", "-u", "-z", "-q", str(mountpoint)], check=False)
        lazy = True
    # After a lazy unmount the server would serve the open files until they close: stop
    # it (SIGTERM makes libfuse leave its loop); those files then fail with ENOTCONN.
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=0 if lazy else 10)
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@functools.cache
def fuse_available() -> str | None:
    """None when a slowfs can be mounted here, else why not (one line, for skip messages)."""
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    if shutil.which("fusermount3") is None:
        return "fusermount3 not found (Debian package fuse3)"
    try:
        import mfusepy
    except (ImportError, OSError) as exc:  # OSError: mfusepy is there but libfuse3 is not
        return f"mfusepy or libfuse3 missing: {exc}".splitlines()[0]
    if mfusepy.fuse_version_major != 3:
        return f"libfuse 3 needed, mfusepy found {mfusepy.fuse_version_major}"
    with tempfile.TemporaryDirectory(prefix="slowfs-probe-") as tmp:
        source = Path(tmp, "src")
        source.mkdir()
        try:
            with mount(source, Path(tmp, "mnt")) as fs:
                fs.stats()
        except Exception as exc:
            return f"cannot mount a FUSE filesystem: {exc}".splitlines()[0]
    return None
