"""spanwarm.testing.slowfs, the emulated network mount: content, counters, costs, page cache, faults
and hangs.

Timing assertions are lower bounds only: a loaded machine may be slower, never faster.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import re
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Protocol

import pytest
from hypothesis import given
from hypothesis import strategies as st

from spanwarm.pagecache.residency import evict, file_residency
from spanwarm.testing.slowfs import Fault, Hang, Preset, SlowFS, fuse_available, mount

_reason = fuse_available()
if _reason is not None:
    pytest.skip(_reason, allow_module_level=True)

MiB = 1 << 20
PAGE = 4096
# Scattered reads land farther apart than the stream tolerance, so each one is a seek.
SLOW = Preset("test-slow", latency_s=0.020, stream_bytes_per_s=64 * MiB, total_bytes_per_s=None)


class Mount(Protocol):
    def __call__(
        self,
        preset: Preset | str = "local",
        *,
        faults: Iterable[Fault] = (),
        hangs: Iterable[Hang] = (),
    ) -> SlowFS: ...


@pytest.fixture
def source(tmp_path: Path) -> Path:
    path = tmp_path / "src"
    path.mkdir()
    return path


@pytest.fixture
def mounted(tmp_path: Path, source: Path) -> Iterator[Mount]:
    """Mount ``source`` with a preset; unmounted at teardown, whatever the test did."""
    with ExitStack() as stack:

        def mount_with(
            preset: Preset | str = "local",
            *,
            faults: Iterable[Fault] = (),
            hangs: Iterable[Hang] = (),
        ) -> SlowFS:
            mnt = tmp_path / "mnt"
            return stack.enter_context(mount(source, mnt, preset, faults=faults, hangs=hangs))

        yield mount_with


def _read_all(path: Path) -> bytes:
    with path.open("rb", buffering=0) as f:
        return f.read()


@contextlib.contextmanager
def _opened(path: Path, *, random_access: bool = True) -> Iterator[int]:
    """A read-only descriptor; with ``random_access``, readahead off (one request per read)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if random_access:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        yield fd
    finally:
        with contextlib.suppress(OSError):  # ENOTCONN once the server is gone
            os.close(fd)


def _page(data: bytes, index: int) -> bytes:
    return data[index * PAGE : (index + 1) * PAGE]


def test_content_and_bytes_served_once_across_opens(source: Path, mounted: Mount) -> None:
    data = os.urandom(8 * MiB)
    (source / "f.bin").write_bytes(data)
    fs = mounted("local")
    path = fs.path("f.bin")
    evict(path)

    assert _read_all(path) == data
    first = fs.stats()
    assert first["files"]["f.bin"]["bytes"] == 8 * MiB
    assert first["bytes"] == 8 * MiB  # and reading the stats file counts nothing

    # Closed and reopened: the page cache still holds every byte (kernel_cache).
    assert _read_all(path) == data
    again = fs.stats()
    assert again["bytes"] == 8 * MiB
    assert again["requests"] == first["requests"]


def test_stats_file_is_fresh_on_every_read(source: Path, mounted: Mount) -> None:
    (source / "a").write_bytes(b"x" * 10000)
    (source / "b").write_bytes(b"y" * 5000)
    fs = mounted("local")
    assert fs.stats()["bytes"] == 0
    assert fs.path("a").read_bytes() == b"x" * 10000
    assert fs.stats()["files"]["a"]["bytes"] == 10000
    assert fs.path("b").read_bytes() == b"y" * 5000
    stats = fs.stats()
    assert stats["bytes"] == 15000
    assert set(stats["files"]) == {"a", "b"}


def test_scattered_reads_pay_latency_each(source: Path, mounted: Mount) -> None:
    with (source / "sparse.bin").open("wb") as f:
        f.truncate(64 * MiB)
    fs = mounted(SLOW)
    path = fs.path("sparse.bin")
    offsets = [i * 3 * MiB for i in range(16)]  # 3 MiB apart: beyond the 2 MiB tolerance
    random.Random(0).shuffle(offsets)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead: one request each
        elapsed = 0.0
        for offset in offsets:
            evict(path)
            start = time.monotonic()
            assert os.pread(fd, 4096, offset) == bytes(4096)
            elapsed += time.monotonic() - start
    finally:
        os.close(fd)
    assert elapsed >= 16 * SLOW.latency_s
    assert fs.stats()["files"]["sparse.bin"]["seeks"] >= 16


def test_sequential_read_pays_latency_about_once(source: Path, mounted: Mount) -> None:
    (source / "seq.bin").write_bytes(os.urandom(8 * MiB))
    fs = mounted(SLOW)
    path = fs.path("seq.bin")
    evict(path)
    assert len(_read_all(path)) == 8 * MiB
    counts = fs.stats()["files"]["seq.bin"]
    assert counts["bytes"] == 8 * MiB
    assert 1 <= counts["seeks"] <= 3
    assert counts["requests"] > counts["seeks"]


def test_stream_bandwidth_caps_a_sequential_read(source: Path, mounted: Mount) -> None:
    (source / "big.bin").write_bytes(os.urandom(16 * MiB))
    fs = mounted(SLOW)
    path = fs.path("big.bin")
    evict(path)
    start = time.monotonic()
    assert len(_read_all(path)) == 16 * MiB
    assert time.monotonic() - start >= 0.2  # 16 MiB at 64 MiB/s is 0.25 s


def test_residency_helpers_work_inside_the_mount(source: Path, mounted: Mount) -> None:
    (source / "r.bin").write_bytes(os.urandom(4 * MiB + 123))
    fs = mounted("local")
    path = fs.path("r.bin")
    _read_all(path)
    assert file_residency(path) == (4 * MiB + 123, 4 * MiB + 123)
    evict(path)
    assert file_residency(path) == (0, 4 * MiB + 123)
    _read_all(path)
    assert file_residency(path) == (4 * MiB + 123, 4 * MiB + 123)
    assert fs.stats()["files"]["r.bin"]["bytes"] == 2 * (4 * MiB + 123)


def test_overrides_and_unmount(source: Path, tmp_path: Path) -> None:
    mountpoint = tmp_path / "mnt"
    with mount(source, mountpoint, "cross-region", latency_s=0.001) as fs:
        assert os.path.ismount(mountpoint)
        preset = fs.stats()["preset"]
        assert preset["latency_s"] == 0.001
        assert preset["stream_bytes_per_s"] == 0.24 * 2**30
        held = fs.path(".slowfs-stats").open("rb")  # busy: unmount falls back to lazy
    held.close()
    assert not os.path.ismount(mountpoint)
    with pytest.raises(TypeError, match="unknown preset knobs"), mount(source, mountpoint, bw=1):
        pass


def test_fault_fails_reads_overlapping_its_range_only(source: Path, mounted: Mount) -> None:
    data = os.urandom(64 * PAGE)
    (source / "f.bin").write_bytes(data)
    (source / "other.bin").write_bytes(data)
    fs = mounted(faults=[Fault("f.bin", 20 * PAGE + 100, PAGE)])  # in pages 20 and 21
    with _opened(fs.path("f.bin")) as fd:
        for page in (20, 21, 20):  # the kernel caches nothing of a failed read: fails again
            with pytest.raises(OSError, match="Input/output error") as raised:
                os.pread(fd, PAGE, page * PAGE)
            assert raised.value.errno == errno.EIO
        with pytest.raises(OSError, match="Input/output error") as raised:
            os.pread(fd, 10, 21 * PAGE + 50)
        assert raised.value.errno == errno.EIO
        failed = fs.stats()
        for page in (19, 22, 0, 63):
            assert os.pread(fd, PAGE, page * PAGE) == _page(data, page)
    assert fs.path("other.bin").read_bytes() == data
    stats = fs.stats()
    # Each failing read failed at least one request (the kernel may retry one once).
    assert stats["faults"] == stats["files"]["f.bin"]["faults"] == failed["faults"] >= 4
    assert stats["files"]["other.bin"]["faults"] == 0
    assert stats["files"]["f.bin"]["requests"] == 4  # served ones only
    assert stats["hangs"] == 0


def test_pages_beside_a_fault_read_fine_after_a_batched_read_failed(
    source: Path, mounted: Mount
) -> None:
    data = os.urandom(64 * PAGE)
    (source / "f.bin").write_bytes(data)
    fs = mounted(faults=[Fault("f.bin", 20 * PAGE, PAGE)])
    with _opened(fs.path("f.bin"), random_access=False) as fd:
        # Readahead batches pages 0-31 in one request, which fails; the kernel then reads
        # the pages this read needs one by one, up to the faulty page: a short read.
        assert os.pread(fd, 64 * PAGE, 0) == data[: 20 * PAGE]
        assert fs.stats()["faults"] >= 1, "the batched request should have failed"
        for page in (21, 19, 22, 31):
            assert os.pread(fd, PAGE, page * PAGE) == _page(data, page)
        with pytest.raises(OSError, match="Input/output error") as raised:
            os.pread(fd, PAGE, 20 * PAGE)
        assert raised.value.errno == errno.EIO


def test_faults_with_a_custom_errno_and_on_several_files(source: Path, mounted: Mount) -> None:
    data = os.urandom(8 * PAGE)
    for name in ("a.bin", "sub/b.bin"):
        (source / name).parent.mkdir(exist_ok=True)
        (source / name).write_bytes(data)
    fs = mounted(
        faults=[
            Fault("a.bin", 0, 1, errno.ENODATA),
            Fault("a.bin", 7 * PAGE, PAGE),
            Fault("sub/b.bin", 3 * PAGE, 2 * PAGE, errno.ESTALE),
        ]
    )
    expected = {
        ("a.bin", 0): errno.ENODATA,
        ("a.bin", 7): errno.EIO,
        ("sub/b.bin", 3): errno.ESTALE,
        ("sub/b.bin", 4): errno.ESTALE,
    }
    for (name, page), code in expected.items():
        with (
            _opened(fs.path(name)) as fd,
            pytest.raises(OSError, match=re.escape(os.strerror(code))),
        ):
            os.pread(fd, PAGE, page * PAGE)
    with _opened(fs.path("a.bin")) as fd:
        assert os.pread(fd, PAGE, PAGE) == _page(data, 1)
    with _opened(fs.path("sub/b.bin")) as fd:
        assert os.pread(fd, PAGE, 5 * PAGE) == _page(data, 5)
    stats = fs.stats()
    assert stats["files"]["a.bin"]["faults"] >= 2
    assert stats["files"]["sub/b.bin"]["faults"] >= 2
    assert (
        stats["faults"] == stats["files"]["a.bin"]["faults"] + stats["files"]["sub/b.bin"]["faults"]
    )


def test_hang_delays_reads_in_its_range_only(source: Path, mounted: Mount) -> None:
    data = os.urandom(64 * PAGE)
    (source / "h.bin").write_bytes(data)
    (source / "whole.bin").write_bytes(data[: 4 * PAGE])
    hang_s = 0.3
    fs = mounted(
        hangs=[Hang("h.bin", hang_s, start=32 * PAGE, length=PAGE), Hang("whole.bin", 0.2)]
    )
    with _opened(fs.path("h.bin")) as fd:
        for page in (0, 31, 33, 63):  # outside the range: served without the hang
            assert os.pread(fd, PAGE, page * PAGE) == _page(data, page)
        assert fs.stats()["hangs"] == 0
        start = time.monotonic()
        assert os.pread(fd, PAGE, 32 * PAGE) == _page(data, 32)
        assert time.monotonic() - start >= hang_s
    start = time.monotonic()
    assert fs.path("whole.bin").read_bytes() == data[: 4 * PAGE]
    assert time.monotonic() - start >= 0.2
    stats = fs.stats()
    assert stats["files"]["h.bin"]["hangs"] == 1
    assert stats["files"]["h.bin"]["requests"] == 5  # a hung read is then served as usual
    assert stats["files"]["whole.bin"]["hangs"] >= 1
    assert stats["faults"] == 0


def test_unmount_while_a_read_hangs_is_bounded(source: Path, tmp_path: Path) -> None:
    (source / "h.bin").write_bytes(os.urandom(4 * PAGE))
    outcome: list[bytes | OSError] = []

    def read(path: Path) -> None:
        try:
            with _opened(path) as fd:
                outcome.append(os.pread(fd, PAGE, 0))
        except OSError as exc:
            outcome.append(exc)

    mountpoint = tmp_path / "mnt"
    with mount(source, mountpoint, hangs=[Hang("h.bin", 60)]) as fs:
        reader = threading.Thread(target=read, args=(fs.path("h.bin"),), daemon=True)
        reader.start()
        deadline = time.monotonic() + 10
        while fs.stats()["hangs"] == 0:
            assert time.monotonic() < deadline, "the read never reached the server"
            time.sleep(0.02)
        start = time.monotonic()
    assert time.monotonic() - start < 15, "unmounting waited for the hung read"
    reader.join(timeout=15)
    assert not reader.is_alive()
    assert len(outcome) == 1
    assert isinstance(outcome[0], OSError)  # EIO, or ENOTCONN/ECONNABORTED once it is gone
    assert not os.path.ismount(mountpoint)


# Relative paths of one to three components, ':' and all.
_components = st.text(st.characters(exclude_characters="/\0"), min_size=1)
names = st.lists(_components.filter(lambda c: c not in (".", "..")), min_size=1, max_size=3).map(
    "/".join
)


@given(
    name=names,
    start=st.integers(0, 2**40),
    length=st.integers(1, 2**40),
    code=st.sampled_from([errno.EIO, errno.ENODATA, errno.ESTALE, 200]),
)
def test_fault_flags_round_trip(name: str, start: int, length: int, code: int) -> None:
    fault = Fault(name, start, length, code)
    assert Fault.parse(fault.to_arg()) == fault


@given(
    name=names,
    seconds=st.floats(0, 1e6),
    start=st.integers(0, 2**40),
    length=st.none() | st.integers(1, 2**40),
)
def test_hang_flags_round_trip(name: str, seconds: float, start: int, length: int | None) -> None:
    hang = Hang(name, seconds, start, length)
    assert Hang.parse(hang.to_arg()) == hang


def test_short_flags_and_bad_values() -> None:
    assert Fault.parse("m.bin:8192:4096") == Fault("m.bin", 8192, 4096, errno.EIO)
    assert Fault.parse("m.bin:0:1:ENODATA") == Fault("m.bin", 0, 1, errno.ENODATA)
    assert Fault.parse("a:b:0:1:EIO") == Fault("a:b", 0, 1)
    assert Hang.parse("a:b:1:0:end") == Hang("a:b", 1.0)
    assert Hang.parse("m.bin:2.5") == Hang("m.bin", 2.5)
    assert Hang.parse("m.bin:1:4096:end") == Hang("m.bin", 1.0, 4096, None)
    assert Hang.parse("m.bin:1:0:4096") == Hang("m.bin", 1.0, 0, 4096)
    bad_faults = ("m.bin", "m.bin:0", "m.bin:-1:10", "m.bin:0:0", "/m.bin:0:1", "./m.bin:0:1")
    for text in (*bad_faults, "a:b:0:1", "m.bin:0:1:EBOGUS", "m.bin:0:1:0", ":0:1", "a//b:0:1"):
        with pytest.raises(ValueError, match=r"got|invalid literal|unknown errno"):
            Fault.parse(text)
    for text in ("m.bin", "m.bin:-1", "m.bin:nan", "m.bin:1:0", "m.bin:1:0:0", "m.bin:1:-1:end"):
        with pytest.raises(ValueError, match=r"got|could not convert"):
            Hang.parse(text)


def test_a_trace_names_each_request_and_who_sent_it(source: Path, tmp_path: Path) -> None:
    (source / "t.bin").write_bytes(os.urandom(4 * MiB))
    trace = tmp_path / "trace.jsonl"
    with mount(source, tmp_path / "mnt", trace=trace) as fs:
        path = fs.path("t.bin")
        evict(path)
        before = time.monotonic()
        with _opened(path) as fd:  # readahead off: one request per read
            assert len(os.pread(fd, 2 * PAGE, MiB)) == 2 * PAGE
            assert len(os.pread(fd, PAGE, 3 * MiB)) == PAGE
        stats = fs.stats()
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert len(lines) == stats["requests"] == 2
    assert [(r["file"], r["offset"], r["size"]) for r in lines] == [
        ("t.bin", MiB, 2 * PAGE),
        ("t.bin", 3 * MiB, PAGE),
    ]
    assert {r["tid"] for r in lines} == {threading.get_native_id()}  # this thread sent both
    assert lines[0]["handle"] == lines[1]["handle"]  # one descriptor
    assert before <= lines[0]["arrival"] <= lines[0]["done"] <= lines[1]["arrival"]
