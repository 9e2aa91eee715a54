"""The security model (docs/daemon.md), tried as hostile local users would try it.

A root daemon serves a socket group; real unprivileged users (created here with
useradd) act through ``tests/integration/as_user.py``, which drops to them before it
does anything. Outcomes are checked where they happen: bytes in the page cache
(mincore), status codes, what every reply names.
"""

from __future__ import annotations

import contextlib
import grp
import json
import mmap
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from spanwarm.client import Client, TensorSpans
from spanwarm.daemon.front_door import inner_socket_path
from spanwarm.pagecache.residency import PAGE, evict, resident_bytes
from spanwarm.testing.slowfs import Hang, fuse_available, mount
from tests.daemon_harness import running_daemon

ROOT = Path(__file__).resolve().parents[2]
GROUP = "swtest"
ALICE, MALLORY, VICTIM, SQUATTER = "swalice", "swmallory", "swvictim", "swsquat"
SECRET_SIZE = 1_000_003  # sizes no reply may name
INNER_SIZE = 1_000_033
OWN_SIZE = 2 * 2**20

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("useradd") is None,
    reason="needs root and useradd: the tests create real unprivileged users",
)


def _ensure_users() -> None:
    try:
        grp.getgrnam(GROUP)
    except KeyError:
        subprocess.run(["groupadd", GROUP], check=True)
    for name, group in ((ALICE, GROUP), (MALLORY, GROUP), (VICTIM, None), (SQUATTER, None)):
        try:
            pwd.getpwnam(name)
        except KeyError:
            extra = ["-G", group] if group else []
            subprocess.run(
                ["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", *extra, name],
                check=True,
            )


def _command(user: str, action: str, args: dict[str, Any]) -> list[str]:
    return [sys.executable, "-m", "tests.integration.as_user", user, action, json.dumps(args)]


def as_user(user: str, action: str, **args: Any) -> dict[str, Any]:
    result = subprocess.run(
        _command(user, action, args),
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    return dict(json.loads(result.stdout.strip().splitlines()[-1]))


def start_as_user(user: str, action: str, **args: Any) -> subprocess.Popen[str]:
    """``as_user`` in the background: its stdout is a pipe, its stderr the test's."""
    return subprocess.Popen(
        _command(user, action, args), stdout=subprocess.PIPE, text=True, cwd=ROOT
    )


def _write(path: Path, size: int, mode: int, owner: str | None = None) -> Path:
    path.write_bytes(os.urandom(size))
    path.chmod(mode)
    if owner:
        entry = pwd.getpwnam(owner)
        os.chown(path, entry.pw_uid, entry.pw_gid)
    evict(path)
    return path


def _cold(path: Path) -> bool:
    fd = os.open(path, os.O_RDONLY)
    try:
        return resident_bytes(fd, 0, os.fstat(fd).st_size) == 0
    finally:
        os.close(fd)


class Area:
    """Files in a directory every test user can traverse (pytest's tmp_path cannot be)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.allowed = root / "allowed"
        self.allowed.mkdir(mode=0o755)
        self.own = _write(self.allowed / "own.bin", OWN_SIZE, 0o644)
        self.secret = _write(self.allowed / "secret.bin", SECRET_SIZE, 0o600)
        self.root_data = _write(self.allowed / "root-data.bin", 4 * 2**20, 0o600)
        self.writable = _write(self.allowed / "write-only.bin", 4096, 0o602)
        locked = self.allowed / "locked"
        locked.mkdir(mode=0o700)
        self.inner = _write(locked / "inner.bin", INNER_SIZE, 0o644)
        self.alice_dir = self.allowed / "alice"
        self.alice_dir.mkdir(mode=0o755)
        entry = pwd.getpwnam(ALICE)
        os.chown(self.alice_dir, entry.pw_uid, entry.pw_gid)
        self.sockets = root / "run"
        self.sockets.mkdir(mode=0o755)


@pytest.fixture(scope="module")
def area() -> Iterator[Area]:
    _ensure_users()
    root = Path(tempfile.mkdtemp(prefix="swsec-", dir="/tmp"))
    root.chmod(0o755)
    try:
        yield Area(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def group_daemon(area: Area, *flags: str, open_files: int | None = None) -> Iterator[Any]:
    with running_daemon(
        "--socket-group",
        GROUP,
        "--allow",
        str(area.allowed),
        "--method",
        "read",
        *flags,
        socket_path=str(area.sockets / "d.sock"),
        open_files=open_files,
    ) as daemon:
        yield daemon


def _names_no_size(result: object, *sizes: int) -> None:
    text = json.dumps(result)
    for size in sizes:
        assert str(size) not in text, (size, text)


def test_a_member_warms_its_own_file_and_nothing_it_cannot_read(area: Area) -> None:
    for path in (area.own, area.secret, area.inner):
        evict(path)
    with group_daemon(area) as daemon:
        result = as_user(
            ALICE,
            "client_warm",
            socket=daemon.socket,
            paths=[str(area.own), str(area.secret), str(area.inner)],
            length=OWN_SIZE,
        )
        assert result["finished"]
        assert result["ready_names"] == [str(area.own)], result
        assert result["ready"] == 1
        assert result["failed"] == 2
        assert {p["path"] for p in result["plan"]} == {str(area.own)}
        assert "Permission denied" in result["failures"][str(area.secret)]
        _names_no_size(result, SECRET_SIZE, INNER_SIZE)
        assert _cold(area.secret)
        assert _cold(area.inner)


# Regular files of kernel file systems anyone may open (sysfs's PCI config gives a user 64
# bytes and root 4096: the daemon, reopening, would read as root).
KERNEL_FILES = {
    "procfs": "/proc/version",
    "sysfs": "/sys/kernel/mm/transparent_hugepage/enabled",
}


def test_the_raw_wire_gets_nothing_past_the_descriptors(area: Area) -> None:
    evict(area.secret)
    evict(area.inner)
    with group_daemon(area) as daemon:
        result = as_user(
            ALICE,
            "raw_warm",
            socket=daemon.socket,
            secret=str(area.secret),
            inner=str(area.inner),
            own=str(area.own),
            own_writable=str(area.writable),
            length=4096,
            kernel_files={k: path for k, path in KERNEL_FILES.items() if os.path.exists(path)},
        )
        assert result["by_name"]["code"] == "UNAUTHENTICATED", result
        assert result["inner_by_name"]["code"] == "UNAUTHENTICATED", result
        assert result["inner_o_path"] == {"code": "LOCAL", "details": "open: Permission denied"}
        # A token for our own file, with the secret's name as its label: the daemon warms
        # what the descriptor is, and shows it by the kernel's name for it.
        swapped = result["label_swap"]
        assert swapped["code"] == "OK", swapped
        assert swapped["plans"] == [{"path": str(area.own), "size_bytes": OWN_SIZE}]
        assert result["reused_token"]["code"] == "UNAUTHENTICATED"
        assert result["guessed_token"]["code"] == "UNAUTHENTICATED"
        assert result["o_path"]["code"] == "PERMISSION_DENIED", result["o_path"]
        assert "not opened for reading" in result["o_path"]["details"]
        assert not result["o_path"]["token"]
        assert result["write_only"]["code"] == "PERMISSION_DENIED", result["write_only"]
        for kind in KERNEL_FILES:
            if kind in result:  # where this machine has the file
                refused = result[kind]
                assert refused["code"] == "FAILED_PRECONDITION", (kind, refused)
                assert f"is on {kind}" in refused["details"], (kind, refused)
                assert not refused["token"]
        assert "procfs" in result
        _names_no_size(result, SECRET_SIZE, INNER_SIZE)
        assert _cold(area.secret)
        assert _cold(area.inner)


def test_status_shows_a_member_only_its_own_ranks_and_files(area: Area) -> None:
    with group_daemon(area) as daemon:
        client = Client(daemon.socket, read_yourself=False)
        ticket = client.request(
            [TensorSpans("w", str(area.root_data), 0, 2**20, 2**20, 1)], job="root-job"
        )
        assert ticket.wait(timeout=30)
        mine = client.status()
        assert [r["job"] for r in mine["ranks"]] == ["root-job"]
        result = as_user(ALICE, "cli", argv=["status", "--json", "--socket", daemon.socket])
        assert result["exit"] == 0, result
        seen = json.loads(result["stdout"])
        assert seen["ranks"] == []
        assert seen["files"] == []
        assert "root-job" not in result["stdout"]
        assert str(area.root_data) not in result["stdout"]
        assert seen["bytes_planned"] == mine["bytes_planned"]  # the node's totals
        ticket.cancel()
        client.close()


def test_consumed_from_another_user_releases_nothing(area: Area) -> None:
    with group_daemon(area) as daemon:
        client = Client(daemon.socket, read_yourself=False)  # held: resident or not
        spans = [
            TensorSpans(f"t{i}", str(area.root_data), i * 2**20, 2**20, 2**20, 1) for i in range(4)
        ]
        ticket = client.request(spans, job="root-job")
        assert ticket.wait(timeout=30)
        held = client.status()["held_bytes"]
        assert held == 4 * 2**20
        result = as_user(ALICE, "consumed", socket=daemon.socket, ids=list(range(1, 65)))
        assert result["codes"] == {"NOT_FOUND": 3 * 64}, result
        assert client.status()["held_bytes"] == held
        ticket.consumed([s.tensor for s in spans])  # our own token does release them
        deadline = time.monotonic() + 10
        while client.status()["held_bytes"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert client.status()["held_bytes"] == 0
        ticket.cancel()
        client.close()


def _descriptors_of(pid: int, path: Path) -> int:
    """How many of process ``pid``'s descriptors are open on ``path``."""
    fds = f"/proc/{pid}/fd"
    targets = []
    for fd in os.listdir(fds):
        with contextlib.suppress(OSError):  # closed meanwhile
            targets.append(os.readlink(f"{fds}/{fd}"))
    return targets.count(str(path))


def test_per_user_caps_refuse_with_their_codes(area: Area) -> None:
    flags = ("--user-max-requests", "2", "--user-max-bytes", "1MiB", "--user-max-rows", "100")
    with group_daemon(area, *flags) as daemon:
        # 101 rows of 4 KiB (404 KiB): within --max-rows and --user-max-bytes, not within
        # --user-max-rows (what planning expands, for every live request of a file at once).
        rows = as_user(
            ALICE, "caps", socket=daemon.socket, own=str(area.own), grants=1, length=4096, count=101
        )
        assert rows["warm"] == "RESOURCE_EXHAUSTED", rows
        assert "more than 100 rows of strided spans (--user-max-rows)" in rows["details"], rows
        within = as_user(
            ALICE, "caps", socket=daemon.socket, own=str(area.own), grants=1, length=4096, count=100
        )
        assert within["warm"] == "OK", within
        # Refused once admitted (its bytes are known then): its file goes back with it,
        # the grant spent on it too. (It stayed open for good, so a user could pin any
        # number of files, one refused request each.)
        refused = as_user(
            ALICE, "caps", socket=daemon.socket, own=str(area.own), grants=1, length=OWN_SIZE
        )
        assert refused["warm"] == "RESOURCE_EXHAUSTED", refused
        deadline = time.monotonic() + 10
        while _descriptors_of(daemon.process.pid, area.own) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _descriptors_of(daemon.process.pid, area.own) == 0
        result = as_user(
            ALICE, "caps", socket=daemon.socket, own=str(area.own), grants=3, length=OWN_SIZE
        )
        # Root is not limited: the same daemon takes its 2 MiB request.
        client = Client(daemon.socket, read_yourself=False)
        ticket = client.request([TensorSpans("r", str(area.own), 0, OWN_SIZE, OWN_SIZE, 1)])
        assert ticket.wait(timeout=30)
        assert ticket.progress.ready == 1
        ticket.cancel()
        client.close()
    assert result["grants"] == ["OK", "OK", "PERMISSION_DENIED"], result
    assert result["warm"] == "RESOURCE_EXHAUSTED", result
    assert "--user-max-bytes" in result["details"]


def test_a_refusal_names_the_file_as_the_daemon_sees_it_never_by_the_callers_label(
    area: Area,
) -> None:
    with group_daemon(area) as daemon:
        result = as_user(
            ALICE,
            "caps",
            socket=daemon.socket,
            own=str(area.own),
            grants=1,
            length=OWN_SIZE + 1,
            label="/etc/shadow \x1b[2J forged",
        )
    assert result["warm"] == "OUT_OF_RANGE", result
    assert result["details"].startswith(f"{area.own}: span 0 ends at {OWN_SIZE + 1}"), result
    assert "shadow" not in result["details"]


def test_one_users_idle_connections_do_not_lock_out_another(area: Area) -> None:
    with group_daemon(area) as daemon:
        hog = start_as_user(MALLORY, "hog", socket=daemon.socket, connections=300, seconds=20)
        try:
            assert hog.stdout is not None
            assert json.loads(hog.stdout.readline())["holding"] > 0
            result = as_user(
                ALICE, "client_warm", socket=daemon.socket, paths=[str(area.own)], length=4096
            )
            assert result["ready"] == 1, result
        finally:
            hog.kill()
            hog.wait()


def test_roots_status_answers_while_a_user_holds_every_connection_it_may(area: Area) -> None:
    """With 1,024 descriptors, users may hold 24 connections to the gRPC socket, one uid
    12 (docs/daemon.md): Mallory's 300 get 12, the daemon's descriptors stay bounded,
    root's status answers at once, Alice still warms, and the refusals are counted."""
    with group_daemon(area, open_files=1024) as daemon:
        descriptors = f"/proc/{daemon.process.pid}/fd"
        before = len(os.listdir(descriptors))
        hog = start_as_user(
            MALLORY, "grpc_hog", socket=daemon.socket, connections=300, speak=True, seconds=3
        )
        try:
            assert hog.stdout is not None
            held = json.loads(hog.stdout.readline())
            assert held["open"] == 12, held
            assert len(os.listdir(descriptors)) <= before + 3 * 12 + 8
            began = time.monotonic()
            with Client(daemon.socket) as root:
                status = root.status()
            assert time.monotonic() - began < 1.0
            refused = {r["cause"]: r["count"] for r in status["refusals"]}
            assert refused.get("too_many_connections", 0) >= 300 - 12, status
            result = as_user(
                ALICE, "client_warm", socket=daemon.socket, paths=[str(area.own)], length=4096
            )
            assert result["ready"] == 1, result
        finally:
            hog.kill()
            hog.wait()


def test_no_user_reaches_grpc_behind_the_door(area: Area) -> None:
    """The inner socket gRPC listens on is in a 0700 directory of the daemon's user: a
    member of the socket group connecting there directly (past the door's per-uid count)
    is refused by the kernel; through the door, the same user is served."""
    with group_daemon(area, open_files=1024) as daemon:
        inner = inner_socket_path(daemon.socket)
        assert os.path.exists(inner)
        direct = as_user(MALLORY, "grpc_hog", socket=inner, connections=5, speak=True, seconds=0)
        door = as_user(
            MALLORY, "grpc_hog", socket=daemon.socket, connections=5, speak=True, seconds=0
        )
    assert direct == {"opened": 0, "open": 0}, direct
    assert door["open"] == 5, door


def test_a_connection_that_never_speaks_is_closed_and_counted_no_more(area: Area) -> None:
    """gRPC closes a connection that has not said its preface within 10 s; the door
    closes the caller's end and frees the uid's place for a connection that speaks."""
    with group_daemon(area, open_files=1024) as daemon:
        mute = as_user(
            MALLORY, "grpc_hog", socket=daemon.socket, connections=12, speak=False, seconds=11
        )
        assert mute == {"opened": 12, "open": 0}, mute
        speaking = as_user(
            MALLORY, "grpc_hog", socket=daemon.socket, connections=12, speak=True, seconds=0
        )
        assert speaking["open"] == 12, speaking


def test_a_descriptor_sent_thousands_of_times_is_held_once(area: Area) -> None:
    with group_daemon(area, "--user-max-files", "5000") as daemon:
        flood = as_user(MALLORY, "fd_flood", socket=daemon.socket, path=str(area.own), datagrams=8)
        fds = len(os.listdir(f"/proc/{daemon.process.pid}/fd"))
        over = as_user(MALLORY, "fd_flood", socket=daemon.socket, path=str(area.own), datagrams=30)
    assert flood["code"] == "OK", flood  # 2,024 references, one descriptor
    assert fds < 64, fds
    assert over["code"] == "RESOURCE_EXHAUSTED", over
    assert "--user-max-files" in over["details"]


def test_a_bind_mount_in_a_private_namespace_does_not_pass_the_allowed_roots(
    area: Area,
) -> None:
    target = area.alice_dir / "ckpt"
    target.mkdir(exist_ok=True)
    entry = pwd.getpwnam(ALICE)
    os.chown(target, entry.pw_uid, entry.pw_gid)
    with group_daemon(area) as daemon:
        result = as_user(
            ALICE,
            "namespace_grant",
            socket=daemon.socket,
            source="/etc",
            target=str(target),
            name="passwd",
        )
    if result["code"] == "SKIP":
        pytest.skip(f"no unprivileged user namespaces here: {result['details']}")
    assert result["code"] == "PERMISSION_DENIED", result
    assert "as the daemon sees the file system" in result["details"]
    assert not result["token"]


def test_a_user_who_may_only_read_a_checkpoint_still_skips_what_is_resident(
    area: Area,
) -> None:
    """mincore lies to a user who may read but not write a file (every page present);
    the rank samples the page cache instead: the resident tensor is read at once and
    not asked for, the cold one goes to the daemon and is waited for."""
    path = _write(area.allowed / "shared-ckpt.bin", 8 * 2**20, 0o644)  # root's, read-only
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        assert len(os.pread(fd, 4 * 2**20, 0)) == 4 * 2**20  # the first tensor resident
        # Kept mapped and read while the rank looks: idle pages here are reclaimed within
        # seconds, and one of the pages it samples gone would make the tensor cold. Under
        # MADV_RANDOM: a page faulted in again brings no read-around of the cold tensor.
        first = mmap.mmap(fd, 4 * 2**20, prot=mmap.PROT_READ)
        first.madvise(mmap.MADV_RANDOM)
    finally:
        os.close(fd)
    tensors = [(str(path), 0, 4 * 2**20), (str(path), 4 * 2**20, 4 * 2**20)]
    looking = threading.Event()

    def keep_accessed() -> None:
        while not looking.wait(0.05):
            _ = first[::PAGE]  # a byte of each page read through the mapping

    keeper = threading.Thread(target=keep_accessed, daemon=True)
    with first, group_daemon(area) as daemon:
        _ = first[::PAGE]
        keeper.start()
        try:
            result = as_user(ALICE, "rank_load", socket=daemon.socket, tensors=tensors)
        finally:
            looking.set()
            keeper.join()
    assert result["outcomes"] == ["read", "ready"]
    assert result["finished"]
    assert (result["resident"], result["ready"]) == (1, 1)
    assert result["needed_bytes"] == 4 * 2**20  # only the cold tensor was asked for


def test_a_socket_directory_root_gave_a_regular_user_is_refused(area: Area) -> None:
    directory = area.root / "squatter"
    directory.mkdir(mode=0o755)
    entry = pwd.getpwnam(SQUATTER)
    os.chown(directory, entry.pw_uid, entry.pw_gid)
    result = subprocess.run(
        [sys.executable, "-m", "spanwarm", "serve", "--socket", str(directory / "d.sock")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    assert f"owner uid {entry.pw_uid}" in result.stderr
    # A client trusts such a directory only for a system account, or one it names.
    from spanwarm.endpoint import trusted_owners

    assert trusted_owners(str(directory), entry.pw_uid + 1, delegate=True)[1] is not None
    os.environ["SPANWARM_DAEMON_USER"] = SQUATTER
    try:
        assert trusted_owners(str(directory), entry.pw_uid + 1, delegate=True)[1] is None
    finally:
        del os.environ["SPANWARM_DAEMON_USER"]


@pytest.mark.parametrize(
    ("seconds", "flags", "bound"),
    [
        # Reads that never return: past --stuck-seconds they stop holding the workers.
        (60.0, ("--workers", "2", "--stuck-seconds", "2"), 15.0),
        # Reads that each take a second (1 MiB pieces take 8): alice is asked to make way,
        # and what she has not finished within a second stops holding a worker.
        (1.0, ("--workers", "2"), 8.0),
    ],
    ids=["hung", "slow"],
)
def test_another_users_slow_or_hung_storage_does_not_hold_the_workers(
    area: Area, seconds: float, flags: tuple[str, ...], bound: float
) -> None:
    if why := fuse_available():
        pytest.skip(f"needs the emulated mount: {why}")
    source = area.root / "hung-src"
    source.mkdir(mode=0o755, exist_ok=True)
    _write(source / "hung.bin", 16 * 2**20, 0o644)
    mnt = area.allowed / "mnt"
    hung = str(mnt / "hung.bin")
    with (
        mount(source, mnt, hangs=[Hang("hung.bin", seconds)], allow_other=True),
        group_daemon(area, *flags) as daemon,
    ):
        # Alice's reads take both workers.
        args = {"socket": daemon.socket, "paths": [hung], "length": 16 * 2**20, "timeout": 40}
        alice = start_as_user(ALICE, "client_warm", **args)
        client = Client(daemon.socket, read_yourself=False)
        try:
            deadline = time.monotonic() + 20
            while client.status()["in_flight"] < 2:
                assert time.monotonic() < deadline, client.status()
                time.sleep(0.1)
            time.sleep(0.5)  # well into their first piece
            evict(area.root_data)
            started = time.monotonic()
            ticket = client.request(
                [TensorSpans("r", str(area.root_data), 0, 2**20, 2**20, 1)], job="root-job"
            )
            assert ticket.wait(timeout=30)
            took = time.monotonic() - started
            assert ticket.progress.ready == 1, ticket.failures
            assert client.status()["in_flight"] >= 2  # alice's reads are still going
            ticket.cancel()
        finally:
            client.close()
            alice.kill()
            alice.wait()
    assert took < bound, took


def test_each_caller_is_shown_its_own_name_for_a_shared_file(area: Area) -> None:
    public = _write(area.alice_dir / "shared.bin", 2 * 2**20, 0o644, owner=ALICE)
    private = area.alice_dir / "private"
    private.mkdir(mode=0o700, exist_ok=True)
    entry = pwd.getpwnam(ALICE)
    os.chown(private, entry.pw_uid, entry.pw_gid)
    secret_name = private / "project-codename" / "weights.bin"
    secret_name.parent.mkdir(exist_ok=True)
    os.chown(secret_name.parent, entry.pw_uid, entry.pw_gid)
    with contextlib.suppress(FileNotFoundError):
        secret_name.unlink()
    os.link(public, secret_name)  # the same inode, under a name only alice may see
    with group_daemon(area) as daemon:
        args = {"socket": daemon.socket, "paths": [str(secret_name)], "length": 4096, "hold": 15}
        alice = start_as_user(ALICE, "client_warm", **args)
        try:
            client = Client(daemon.socket, read_yourself=False)
            deadline = time.monotonic() + 20
            while not client.status()["ranks"]:  # alice's request is live
                assert time.monotonic() < deadline
                time.sleep(0.1)
            client.close()
            seen = as_user(
                MALLORY, "client_warm", socket=daemon.socket, paths=[str(public)], length=4096
            )
            status = as_user(MALLORY, "cli", argv=["status", "--json", "--socket", daemon.socket])
        finally:
            alice.kill()
            alice.wait()
    assert seen["ready"] == 1, seen
    assert [p["path"] for p in seen["plan"]] == [str(public)]
    assert "project-codename" not in json.dumps(seen)
    assert "project-codename" not in status["stdout"]


def test_a_symlink_swap_race_never_reaches_etc_shadow(area: Area) -> None:
    shadow = os.stat("/etc/shadow").st_size
    link, plain = area.alice_dir / "link", area.alice_dir / "plain"
    with contextlib.suppress(FileNotFoundError):
        link.unlink()
    link.symlink_to("/etc/shadow")
    _write(plain, 8192, 0o644, owner=ALICE)
    with group_daemon(area) as daemon:
        result = as_user(
            ALICE, "race", socket=daemon.socket, link=str(link), plain=str(plain), requests=400
        )
    assert result["swaps"] > 0
    assert shadow not in result["sizes"], result
    assert set(result["sizes"]) <= {8192}
    assert result["codes"].get("UNAUTHENTICATED", 0) == 200  # by name: never served


def test_tcp_serves_health_and_nothing_else(area: Area) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    address = f"127.0.0.1:{port}"
    with group_daemon(area, "--listen", address) as daemon:
        for user in (None, ALICE):
            args = {"address": address, "path": str(area.own)}
            result = (
                as_user(user, "tcp", **args)
                if user
                else json.loads(
                    subprocess.run(
                        [sys.executable, "-c", _TCP_AS_ROOT, json.dumps(args)],
                        capture_output=True,
                        text=True,
                        check=True,
                        cwd=ROOT,
                        timeout=120,
                    ).stdout
                )
            )
            assert result["health"] == "SERVING", result
            assert result["warm"] == "UNIMPLEMENTED", result
            assert result["status"] == "UNIMPLEMENTED", result
            assert result["consumed"] == "UNIMPLEMENTED", result
            assert "spanwarm.v1.Warmer" not in result["reflection"], result
        assert daemon.process.poll() is None


_TCP_AS_ROOT = """
import json, sys
from tests.integration import as_user
print(json.dumps(as_user._ACTIONS["tcp"](json.loads(sys.argv[1]))))
"""


def test_a_squatted_socket_directory_gets_nothing(area: Area) -> None:
    victim = pwd.getpwnam(VICTIM)
    directory = Path(tempfile.gettempdir()) / f"spanwarm-{victim.pw_uid}"
    shutil.rmtree(directory, ignore_errors=True)
    own = _write(area.root / "victim.bin", 8192, 0o644, owner=VICTIM)
    squatter = start_as_user(SQUATTER, "squat", directory=str(directory), seconds=25)
    try:
        assert squatter.stdout is not None
        assert json.loads(squatter.stdout.readline())["listening"]
        load = as_user(VICTIM, "victim_load", path=str(own))
        assert load["socket"] == str(directory / "spanwarm.sock")
        assert load["finished"]
        assert load["seconds"] < 10, load
        assert load["released"] == 1
        serve = as_user(VICTIM, "cli", argv=["serve"])
        assert serve["exit"] == 2, serve
        line = serve["stderr"].strip()
        assert len(line.splitlines()) == 1, line
        assert str(directory) in line
        assert f"owner uid {pwd.getpwnam(SQUATTER).pw_uid}" in line
        assert "mode 0777" in line
        heard = json.loads(squatter.communicate(timeout=60)[0].strip().splitlines()[-1])
        assert heard == {"received": 0, "connections": 0}
    finally:
        squatter.kill()
        squatter.wait()
        shutil.rmtree(directory, ignore_errors=True)


def test_the_per_user_default_directory_is_created_private(area: Area) -> None:
    victim = pwd.getpwnam(VICTIM)
    directory = Path(tempfile.gettempdir()) / f"spanwarm-{victim.pw_uid}"
    shutil.rmtree(directory, ignore_errors=True)
    server = start_as_user(VICTIM, "cli", argv=["serve"])
    try:
        deadline = time.monotonic() + 30
        while not (directory / "spanwarm.sock.access").exists():
            assert server.poll() is None, server.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.1)
        st = directory.stat()
        assert (st.st_uid, st.st_mode & 0o777) == (victim.pw_uid, 0o700)
        assert (directory / "spanwarm.sock").stat().st_mode & 0o777 == 0o600
    finally:
        server.terminate()
        server.communicate(timeout=30)
        shutil.rmtree(directory, ignore_errors=True)


def test_one_uid_holds_at_most_half_the_descriptors_the_daemon_leaves_to_users(
    area: Area,
) -> None:
    """With 1,024 descriptors: 256 kept for root and the daemon's user, 768 for users, of
    them 672 for files, 336 for one uid, whatever --user-max-files says; another user still
    gets its grant."""
    with group_daemon(area, "--user-max-files", "100000", open_files=1024) as daemon:
        held = as_user(MALLORY, "fd_flood", socket=daemon.socket, path=str(area.own), datagrams=1)
        over = as_user(MALLORY, "fd_flood", socket=daemon.socket, path=str(area.own), datagrams=1)
        other = as_user(
            ALICE, "client_warm", socket=daemon.socket, paths=[str(area.own)], length=4096
        )
    assert held["code"] == "OK", held  # 253 references, an unused grant
    assert over["code"] == "RESOURCE_EXHAUSTED", over  # 506 > 336
    assert "more than 336 files" in over["details"], over
    assert other["ready"] == 1, other


def test_one_users_hung_file_system_holds_up_only_its_own_closes(area: Area) -> None:
    """Mallory's FUSE server never answers a close (FLUSH). Her refused descriptors are
    closed in her own checking threads, her granted file's in its file system's lane:
    Alice's descriptors, on another file system, still close as her requests end."""
    if why := fuse_available():
        pytest.skip(f"needs the emulated mount: {why}")
    source = area.root / "flush-src"
    source.mkdir(mode=0o755, exist_ok=True)
    _write(source / "hung.bin", 2**20, 0o644)
    outside, inside = area.root / "flush-out", area.allowed / "flush-in"
    mallory: list[subprocess.Popen[str]] = []
    with contextlib.ExitStack() as mounts:
        # Torn down before the daemon and Mallory's processes are waited for: a process
        # closing a file there (at exit too) waits until the server stops.
        mounts.enter_context(mount(source, outside, allow_other=True, hang_flush=["hung.bin"]))
        mounts.enter_context(mount(source, inside, allow_other=True, hang_flush=["hung.bin"]))
        with group_daemon(area) as daemon:
            try:
                baseline = len(os.listdir(f"/proc/{daemon.process.pid}/fd"))
                # Two refused grants (outside the allowed roots), one served and ended.
                mallory.extend(
                    start_as_user(
                        MALLORY,
                        "client_warm",
                        socket=daemon.socket,
                        paths=[str(path / "hung.bin")],
                        length=4096,
                        timeout=5,
                    )
                    for path in (outside, outside, inside)
                )
                time.sleep(3)  # her closes are stuck by now
                for _ in range(10):
                    alice = as_user(
                        ALICE,
                        "client_warm",
                        socket=daemon.socket,
                        paths=[str(area.own)],
                        length=4096,
                    )
                    assert alice["ready"] == 1, alice
                deadline = time.monotonic() + 10
                while (held := len(os.listdir(f"/proc/{daemon.process.pid}/fd"))) > baseline + 3:
                    assert time.monotonic() < deadline, (held, baseline)
                    time.sleep(0.1)
            finally:
                for process in mallory:
                    process.kill()
                mounts.close()
    for process in mallory:
        process.wait(timeout=60)


def test_closes_a_users_file_system_never_answers_count_against_that_user(area: Area) -> None:
    """Mallory's FUSE server never answers a close. Each grant of hers that lapses leaves
    its file closing in her file system's lane, charged to her: with --user-max-files 3,
    her fourth grant is refused, naming the closes, and the daemon's descriptors stay
    bounded; Alice still warms."""
    if why := fuse_available():
        pytest.skip(f"needs the emulated mount: {why}")
    source = area.root / "closing-src"
    source.mkdir(mode=0o755, exist_ok=True)
    names = [f"closing-{i}.bin" for i in range(5)]
    for name in names:
        _write(source / name, 4096, 0o644)
    inside = area.allowed / "closing-in"
    mallory = None
    with contextlib.ExitStack() as mounts:
        mounts.enter_context(mount(source, inside, allow_other=True, hang_flush=names))
        with group_daemon(area, "--user-max-files", "3", "--grant-seconds", "1") as daemon:
            try:
                baseline = len(os.listdir(f"/proc/{daemon.process.pid}/fd"))
                mallory = start_as_user(
                    MALLORY,
                    "grant_each",
                    socket=daemon.socket,
                    paths=[str(inside / name) for name in names],
                    pause=2.5,  # each grant lapses (1 s, checked every second) before the next
                )
                assert mallory.stdout is not None
                replies = json.loads(mallory.stdout.readline())["replies"]
                assert [r["code"] for r in replies[:3]] == ["OK"] * 3, replies
                assert replies[3]["code"] == "RESOURCE_EXHAUSTED", replies
                assert "3 of its files are still closing" in replies[3]["details"], replies
                assert len(os.listdir(f"/proc/{daemon.process.pid}/fd")) <= baseline + 4
                alice = as_user(
                    ALICE, "client_warm", socket=daemon.socket, paths=[str(area.own)], length=4096
                )
                assert alice["ready"] == 1, alice
            finally:
                if mallory is not None:
                    mallory.kill()
                mounts.close()
    if mallory is not None:
        mallory.wait(timeout=60)
