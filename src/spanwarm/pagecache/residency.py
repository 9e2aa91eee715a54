"""Page-cache residency of file byte ranges, and eviction from the page cache.

Residency comes from ``mincore(2)`` on a fresh shared mapping, which reports a page only
once it is uptodate, looked up page by page (60-90 ns a page here). ``cachestat(2)`` counts
a range's pages in one call (15-40 ns a page), but counts pages still being read as
well: :func:`missing_bytes` uses it to skip runs wholly absent, and, where the caller
accepts pages in flight as present, runs wholly cached; :func:`probably_cached` looks at
windows of a long range only, for a reader deciding what to read itself. The kernel
makes mincore report every page present (and cachestat fail) unless the caller owns the
file, may write it, or is privileged, so check :func:`residency_trusted` before
believing it. Anyone who may read a file can still sample it (:func:`sampled_resident`):
a one-byte read with ``RWF_NOWAIT`` is answered from the page cache, or refused rather
than wait for the storage.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import resource
import stat
import time

import numpy as np

from spanwarm.pagecache.memory_map import mapped, mincore

__all__ = [
    "PAGE",
    "cached_throughout",
    "evict",
    "file_residency",
    "missing_bytes",
    "open_trusted",
    "probably_cached",
    "residency_trusted",
    "resident_bytes",
    "resident_pages",
    "sampled_resident",
]

PAGE = os.sysconf("SC_PAGE_SIZE")

# Gap between DONTNEED attempts: pages still under readahead I/O survive one call.
_EVICT_RETRY_S = 0.03

_libc = ctypes.CDLL(None, use_errno=True)
_SYS_CACHESTAT = 451  # the same number on every architecture (Linux 6.5+)


class _CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_uint64)
        for name in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")
    ]


_cachestat_available = [True]  # until the kernel answers ENOSYS (older than 6.5, seccomp)


def cached_pages(fd: int, start: int, length: int) -> int | None:
    """Pages of ``[start, start + length)`` of open file ``fd`` (page-aligned ``start``, a
    ``length`` > 0) in the page cache, pages still being read included, by ``cachestat(2)``;
    None where the kernel will not say (older kernel, or ``EPERM``: the caller may not
    see this file's residency)."""
    if not _cachestat_available[0]:
        return None
    span, counts = _CachestatRange(start, length), _Cachestat()
    if _libc.syscall(_SYS_CACHESTAT, fd, ctypes.byref(span), ctypes.byref(counts), 0) == 0:
        return int(counts.nr_cache)
    if ctypes.get_errno() == errno.ENOSYS:
        _cachestat_available[0] = False
    return None


def resident_bytes(fd: int, offset: int, length: int, *, counted: bool = False) -> int:
    """Bytes of ``[offset, offset + length)`` of open file ``fd`` that are in the page cache.

    A partly covered first or last page counts for the bytes of the range it holds, so a
    fully resident range gives exactly ``length``. Bytes past the end of the file are never
    resident. ``fd`` must be open for reading.

    ``counted``: where ``cachestat`` finds pages of the range missing, its count is the
    answer (pages still being read included, short of ``length``), with no page looked
    at: for a reader that only reads what is not wholly resident (the daemon, before each
    piece: the piece its stream's read-ahead has begun is partly in, and a mapping for
    mincore took the process's mmap lock for writing twice a piece).
    """
    if offset < 0 or length < 0:
        raise ValueError(f"offset and length must be >= 0, got {offset} and {length}")
    end = min(offset + length, os.fstat(fd).st_size)
    if end <= offset:
        return 0
    start = offset - offset % PAGE
    cached = None
    if counted:
        pages = (end - start + PAGE - 1) // PAGE
        cached = cached_pages(fd, start, pages * PAGE)
        if cached is not None and cached < pages:
            return min(cached * PAGE, end - offset - 1)
    # Every page counted present: looked at with no second cachestat.
    bits = (
        _mincore_pages(fd, start, end - start) if cached else resident_pages(fd, start, end - start)
    )
    pages = len(bits)
    resident = int(bits.sum()) * PAGE
    # Trim the parts of the first and last page that lie outside the range.
    if bits[0]:
        resident -= offset - start
    if bits[-1]:
        resident -= start + pages * PAGE - end
    return resident


def resident_pages(fd: int, start: int, length: int) -> np.ndarray:
    """Per page of ``[start, start + length)`` of open file ``fd`` (``start`` page-aligned):
    1 where the page is in the page cache, else 0 (pages past the end of the file: 0).

    A range ``cachestat`` finds wholly absent is not mapped: a mapping's mmap and munmap
    take the process's mmap lock for writing, which stalls every other thread's
    populate and mincore meanwhile (the daemon checks each cold piece before reading it)."""
    if length > 0 and cached_pages(fd, start, length) == 0:
        return np.zeros((length + PAGE - 1) // PAGE, dtype=np.uint8)
    return _mincore_pages(fd, start, length)


def _mincore_pages(fd: int, start: int, length: int) -> np.ndarray:
    """:func:`resident_pages` by ``mincore`` on a mapping of the range."""
    with mapped(fd, start, length) as addr:
        return np.frombuffer(mincore(addr, length), dtype=np.uint8) & 1


_WINDOW = 4 * 2**30  # missing_bytes maps and checks a run this much at a time
_BRIDGE = 4 * 2**20  # missing_bytes checks gaps this small rather than split a run


def missing_bytes(
    fd: int, lo: np.ndarray, hi: np.ndarray, *, reading_counts: bool = False
) -> np.ndarray:
    """Per range ``[lo[i], hi[i])`` of open regular file ``fd``: bytes on pages not in the
    page cache (whole pages, so a partly covered page counts in full; bytes past the end
    of the file count as missing). Ranges are merged into runs (gaps under 4 MiB bridged).
    ``cachestat`` counts each run, then, where the run is partly cached, each of its
    ranges if it has at most ``_RANGES_COUNTED``; whatever it finds wholly absent is
    missing whole, and the rest is checked with ``mincore``, 4 GiB at a time: the work
    follows the ranges and what is missing of them, not the file.
    ``reading_counts``: pages still being read in count as present, so cachestat's count
    is the answer wherever it counted (for a reader that will read those pages itself:
    its reads wait for them; never to say the bytes are warm)."""
    lo, hi = np.asarray(lo, dtype=np.int64), np.asarray(hi, dtype=np.int64)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise ValueError("not a regular file: its residency means nothing")
    size = st.st_size
    missing = np.maximum(hi - np.maximum(lo, size), 0)  # past the end of the file
    keep = (hi > lo) & (lo < size)
    if not keep.any():
        return np.where(hi > lo, missing, 0)
    first = lo // PAGE  # first page of each range, and one past its last page in the file
    last = (np.minimum(hi, size) - 1) // PAGE + 1
    ranges = np.flatnonzero(keep)
    ranges = ranges[np.argsort(first[ranges], kind="stable")]
    reach = np.maximum.accumulate(last[ranges])
    new_run = np.r_[True, first[ranges][1:] > reach[:-1] + _BRIDGE // PAGE]
    heads = np.flatnonzero(new_run)
    run_first = first[ranges][heads]
    run_last = np.maximum.reduceat(last[ranges], heads)
    tails = np.r_[heads[1:], len(ranges)]
    for run, (start, stop) in enumerate(zip(run_first.tolist(), run_last.tolist(), strict=True)):
        members = ranges[heads[run] : tails[run]]
        cached = cached_pages(fd, start * PAGE, (stop - start) * PAGE)
        if cached == 0:
            missing[members] += (last[members] - first[members]) * PAGE
            continue
        if reading_counts and cached is not None and cached >= stop - start:
            continue
        if cached is None or len(members) > _RANGES_COUNTED:
            _count_absent(fd, start, stop, members, first, last, missing)
            continue
        for member in members.tolist():  # partly cached: which of its ranges, and how much
            a, b = int(first[member]), int(last[member])
            cached = cached_pages(fd, a * PAGE, (b - a) * PAGE)
            if cached == 0 or (reading_counts and cached is not None):
                missing[member] += (b - a - (cached or 0)) * PAGE  # what cachestat lacks
            else:
                _count_absent(fd, a, b, np.array([member]), first, last, missing)
    return np.where(hi > lo, missing, 0)


_RANGES_COUNTED = 64  # missing_bytes counts a partly cached run's ranges one by one up to this

# probably_cached: a range up to _PROBE_WHOLE is looked at whole (one call; each page
# costs 15-40 ns, the call 2-3 us), a longer one in windows of _PROBE_WINDOW bytes, one
# every _PROBE_SPACING from its first byte and one ending at its last.
_PROBE_WHOLE = 2**20
_PROBE_WINDOW = 64 * 2**10
_PROBE_SPACING = 4 * 2**20


def probably_cached(
    fd: int, lo: np.ndarray | list[int], hi: np.ndarray | list[int]
) -> np.ndarray | None:
    """Per range ``[lo[i], hi[i])`` of open file ``fd``: True where every page looked at
    is in the page cache, pages still being read included (``cachestat(2)``): all of a
    range up to 1 MiB, and of a longer one a 64 KiB window every 4 MiB from its first
    byte and one ending at its last (reclaim takes a range read front to back from its
    front first, and a read still under way has yet to reach its end). Ranges that touch
    (one starts where another ends) are looked at as one run, and a window missing pages
    settles every range of its run (a caller counts those exactly if it needs to know
    which). The cost follows the ranges, not their bytes: an exact count of a rank's
    resident share, page by page, was a tenth of its load's CPU (6144 lookups for one
    24 MiB tensor, as long as copying a few MiB of it). So a hole of up to 4 MiB between
    windows can go unseen: for a reader deciding what to read itself, which then reads
    such a hole cold, as it would have anyway; never to say bytes are warm. An empty
    range is cached; one past the end of the file is not. None where the kernel will not
    say."""
    # Plain ints: a rank's check probes a few ranges a file, where numpy's per-call cost
    # (microseconds) is more than the system calls'.
    starts, stops = _ints(lo), _ints(hi)
    answer = np.zeros(len(starts), dtype=bool)
    runs, empty, _ = _probe_runs(starts, stops, os.fstat(fd).st_size)
    answer[empty] = True
    for start, stop, members in runs:
        cached = _run_cached(fd, start, stop)
        if cached is None:
            return None
        if cached:
            answer[members] = True
    return answer


def cached_throughout(fd: int, lo: list[int], hi: list[int]) -> bool | None:
    """Whether :func:`probably_cached` finds every range cached, looking no further than
    the first that is not (a resident rank's check is this, file by file, in line)."""
    runs, _, past_end = _probe_runs(lo, hi, os.fstat(fd).st_size)
    if past_end:
        return False
    for start, stop, _ in runs:
        cached = _run_cached(fd, start, stop)
        if not cached:
            return cached
    return True


def _probe_runs(
    starts: list[int], stops: list[int], size: int
) -> tuple[list[tuple[int, int, list[int]]], list[int], bool]:
    """The ranges as runs to probe (start, stop, the ranges in it), in file order; the
    empty ranges; whether any range goes past the end of a file of ``size`` bytes."""
    runs: list[tuple[int, int, list[int]]] = []
    empty: list[int] = []
    past_end = False
    for i in sorted(range(len(starts)), key=starts.__getitem__):
        start, stop = starts[i], stops[i]
        if stop <= start:
            empty.append(i)
        elif stop > size:
            past_end = True  # not cached
        elif runs and runs[-1][1] == start:
            # It starts where the run before it ends (a rank's whole tensors side by side
            # in a file): one set of windows for all of them.
            runs[-1][2].append(i)
            runs[-1] = (runs[-1][0], stop, runs[-1][2])
        else:
            runs.append((start, stop, [i]))
    return runs, empty, past_end


def _run_cached(fd: int, start: int, stop: int) -> bool | None:
    """Whether every page of ``[start, stop)``'s windows is cached (None: not known)."""
    first = start - start % PAGE
    if stop - first <= _PROBE_WHOLE:
        windows = [(first, stop - first)]
    else:
        last = stop - _PROBE_WINDOW
        last -= last % PAGE
        windows = [(at, _PROBE_WINDOW) for at in range(first, last, _PROBE_SPACING)]
        windows.append((last, stop - last))
    for at, length in windows:
        pages = cached_pages(fd, at, length)
        if pages is None or pages < (length + PAGE - 1) // PAGE:
            return None if pages is None else False
    return True


def _ints(values: np.ndarray | list[int]) -> list[int]:
    return values if isinstance(values, list) else np.asarray(values).tolist()


def _count_absent(
    fd: int,
    start: int,
    stop: int,
    members: np.ndarray,
    first: np.ndarray,
    last: np.ndarray,
    missing: np.ndarray,
) -> None:
    """Add to ``missing[members]`` the bytes of their pages (``first`` to ``last``, within
    pages ``start`` to ``stop``) that mincore finds absent."""
    for window in range(start, stop, _WINDOW // PAGE):
        end = min(window + _WINDOW // PAGE, stop)
        with mapped(fd, window * PAGE, (end - window) * PAGE) as addr:
            vec = mincore(addr, (end - window) * PAGE)
        pages = min(len(vec), end - window)
        absent = np.zeros(pages + 1, dtype=np.int64)
        np.cumsum((np.frombuffer(vec, dtype=np.uint8)[:pages] & 1) == 0, out=absent[1:])
        a = np.clip(first[members] - window, 0, pages)
        b = np.clip(last[members] - window, 0, pages)
        missing[members] += (absent[b] - absent[a]) * PAGE


SAMPLE_STRIDE = 2 * 2**20  # sampled_resident looks at one page per this many bytes
# A one-byte read the page cache answers takes microseconds; one slower than this went to
# the storage or queued behind it (a cold page read inside the call, a busy device),
# unless the thread was only preempted meanwhile (a busy node's CPU).
SLOW_SAMPLE_S = 50e-6


def _switches() -> tuple[int, int]:
    """This thread's context switches so far: (voluntary, involuntary). Waiting for a page
    or a device queue sleeps (voluntary); another task taking the CPU is involuntary."""
    usage = resource.getrusage(resource.RUSAGE_THREAD)
    return usage.ru_nvcsw, usage.ru_nivcsw


def sampled_resident(
    fd: int, lo: np.ndarray, hi: np.ndarray, *, misses: int, samples: int, deadline: float
) -> tuple[np.ndarray, int, int]:
    """Per range ``[lo[i], hi[i])`` of open regular file ``fd``, in order: whether every
    page looked at is in the page cache (the first and last page, and one every
    ``SAMPLE_STRIDE`` between), by reading one byte of each with ``RWF_NOWAIT``. For files
    whose mincore cannot be believed: any reader may do this.

    The kernel refuses such a read (``EAGAIN``) rather than wait for the storage, but it
    starts reading the page in (one page where ``fd`` has ``POSIX_FADV_RANDOM``), and that
    may queue behind a busy device, or even finish inside the call. So a page refused, or
    read slower than ``SLOW_SAMPLE_S``, counts as missing, unless the thread was preempted
    and did not sleep meanwhile (a busy CPU, no sign of the storage), and the search stops once
    ``misses`` pages were (a cold checkpoint shows after a few), after ``samples`` reads in
    all, or at ``deadline`` (``time.monotonic``); ranges not looked at are not resident.
    Returns the per-range answer and what is left of both budgets. Raises ``OSError``
    where the file system refuses ``RWF_NOWAIT``, ``ValueError`` for anything but a
    regular file."""
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        raise ValueError("not a regular file: its residency means nothing")
    resident = np.zeros(len(lo), dtype=bool)
    byte = bytearray(1)
    for i, (start, stop) in enumerate(zip(lo.tolist(), hi.tolist(), strict=True)):
        if misses <= 0 or samples <= 0 or time.monotonic() > deadline:
            break
        if stop <= start:
            continue
        inner = range(start - start % PAGE + SAMPLE_STRIDE, stop - 1, SAMPLE_STRIDE)
        places = [start, *inner, stop - 1] if stop - 1 > start else [start]
        if len(places) > samples:
            break  # not all of it can be looked at: the rest is not known resident
        for at in places:
            samples -= 1
            switches = _switches()  # this read's own: an earlier preemption excuses nothing
            began = time.perf_counter()
            try:
                got = os.preadv(fd, [byte], at, os.RWF_NOWAIT)
            except BlockingIOError:  # EAGAIN: not in the page cache
                got = 0
            slow = time.perf_counter() - began > SLOW_SAMPLE_S
            if slow:
                now = _switches()
                slow = now[0] != switches[0] or now[1] == switches[1]  # slept, or not preempted
            if got != 1 or slow:
                misses -= 1  # missing, past the end of the file, or from the storage
                break
        else:
            resident[i] = True
    return resident, misses, samples


@functools.cache
def _root_of_the_host() -> bool:
    """Whether uid 0 here is the host's root (no user namespace maps it): root in a
    rootless container is not privileged over files its namespace does not map."""
    try:
        # Bytes: decoding as text imports a codec first (a millisecond in a fresh rank).
        with open("/proc/self/uid_map", "rb") as f:
            return f.read().split() == [b"0", b"0", b"4294967295"]
    except OSError:
        return False


def residency_trusted(path_or_fd: int | str | os.PathLike[str]) -> bool:
    """Whether mincore tells this process the truth about the file.

    The kernel reveals residency only to the owner, to whoever may write the file, or to
    root; everyone else is told every page is present.
    """
    euid = os.geteuid()
    if euid == 0 and _root_of_the_host():
        return True
    if isinstance(path_or_fd, int):
        st_uid = os.fstat(path_or_fd).st_uid
        # Unreadable after a uid change (not dumpable): access() then says no, which is safe.
        path: str | os.PathLike[str] = f"/proc/self/fd/{path_or_fd}"
    else:
        st_uid = os.stat(path_or_fd).st_uid
        path = path_or_fd
    return st_uid == euid or os.access(path, os.W_OK, effective_ids=True)


def open_trusted(path: str) -> int:
    """A descriptor of ``path`` (read-only, non-blocking) whose residency this process may
    see (:func:`residency_trusted`), or -1: it will not open, or the kernel would lie."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return -1
    try:
        if residency_trusted(fd):
            return fd
    except OSError:
        pass
    os.close(fd)
    return -1


def file_residency(path: str | os.PathLike[str]) -> tuple[int, int]:
    """(resident bytes, size) of the whole file at ``path``."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        return resident_bytes(fd, 0, size), size
    finally:
        os.close(fd)


def evict(
    path: str | os.PathLike[str], offset: int = 0, length: int = 0, *, attempts: int = 20
) -> None:
    """Drop ``[offset, offset + length)`` of ``path`` from the page cache and check it left.

    ``length`` 0 means to the end of the file, as for ``posix_fadvise``. DONTNEED skips
    pages still under I/O (and dirty ones until written back), so it is repeated until
    mincore shows nothing resident; RuntimeError after ``attempts`` tries, or at once when
    mincore cannot be trusted for this file. DONTNEED drops only folios lying wholly inside
    the range, and buffered writes leave 2 MiB folios on ext4 (Linux 6.18), so a sub-range
    of a freshly written file may never go: evict the whole file first.
    """
    if attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts}")
    name = os.fspath(path)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if not residency_trusted(fd):
            raise RuntimeError(f"{name}: cannot verify eviction, mincore is not trusted here")
        span = length if length else max(os.fstat(fd).st_size - offset, 0)
        os.fdatasync(fd)  # dirty pages cannot be dropped
        resident = 0
        for attempt in range(attempts):
            if attempt:
                time.sleep(_EVICT_RETRY_S)
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
            resident = resident_bytes(fd, offset, span)
            if resident == 0:
                return
    finally:
        os.close(fd)
    raise RuntimeError(
        f"{name}: {resident} bytes of [{offset}, {offset + span}) still resident "
        f"after {attempts} DONTNEED attempts"
    )
