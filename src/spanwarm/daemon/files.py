"""The node's file table: every file a live request needs, open once by identity.

A file comes as a descriptor its caller opened (its proof that it may read the file,
:mod:`spanwarm.daemon.access`), or opened by name for the daemon's own user only. Either
way the allowed roots are checked on the kernel's name for what is open (reached through
no symlink, and seen at that name by the daemon itself), files must be regular (a FIFO
is never read) and not the kernel's own (:mod:`.file_systems`), and they are shared by
identity across every request on the node.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import stat
import threading
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from spanwarm.daemon.file_systems import kernel_file_system
from spanwarm.daemon.mount_advice import MountAdvice
from spanwarm.errors import (
    AccessDeniedError,
    ElsewhereForDaemonError,
    FileChangedError,
    InvalidRequestError,
    NotARegularFileError,
    OutsideAllowedRootsError,
    PathNotAllowedError,
    RequestTooLargeError,
    ShardMissingError,
    SpanwarmError,
    StorageError,
)
from spanwarm.pagecache.residency import residency_trusted

__all__ = [
    "Adopted",
    "FileIdentity",
    "FileTable",
    "OpenFile",
    "kernel_name",
    "lookup_error",
]


_O_PATH = getattr(os, "O_PATH", 0o10000000)  # a descriptor that can name, not read
_MAX_SHOWN = 200  # characters of a caller's path quoted back in a message


def _shown(path: str) -> str:
    """A caller's path for a message: quoted, escaped to ASCII, cut short if it is huge."""
    text = ascii(path)
    return text if len(text) <= _MAX_SHOWN else f"{text[:_MAX_SHOWN]}...' ({len(path)} chars)"


def lookup_error(path: str, exc: OSError) -> SpanwarmError:
    """The documented refusal for an ``OSError`` from looking a file up or opening it."""
    cause = f"{exc.strerror or exc} ({errno.errorcode.get(exc.errno or 0, exc.errno)})"
    if exc.errno in (errno.ENOENT, errno.ENOTDIR):
        return ShardMissingError(path, f"no such file: {cause}")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return PathNotAllowedError(path, f"cannot be read by the daemon: {cause}")
    if exc.errno in (errno.EMFILE, errno.ENFILE):
        return RequestTooLargeError(
            f"file {_shown(path)}: the daemon is out of file descriptors ({cause}); "
            "fewer files per request (--max-files), or a higher LimitNOFILE"
        )
    if exc.errno == errno.ENAMETOOLONG:
        return InvalidRequestError(f"file {_shown(path)}: {cause}")
    if exc.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO, errno.ENODEV):
        return NotARegularFileError(path, f"cannot be opened as a regular file: {cause}")
    return StorageError(path, f"the storage failed the lookup: {cause}")


@dataclass(frozen=True, slots=True)
class FileIdentity:
    device: int
    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileIdentity:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class OpenFile:
    """A file some live request needs, open once for the whole node.

    ``path`` is the kernel's name for the open file (``/proc/self/fd``), never a name a
    caller chose: it is what messages, logs and ``Status`` show, whoever asked.
    """

    def __init__(self, path: str, fd: int, identity: FileIdentity) -> None:
        self.path = path
        self.fd = fd
        self.identity = identity
        self.trusted = residency_trusted(fd)  # mincore tells the truth for this file
        self.refs = 0
        self.failed = False  # changed under us: its requests failed, it is not planned again
        # Where the file may be (the allowed roots; None: anywhere): checked as it is warmed.
        self.allowed: Callable[[str], bool] | None = None
        # The uid that handed it over first: its close, if the file system never answers
        # it, counts against that uid (daemon/closer.py). None: the daemon's own.
        self.owner: int | None = None

    @classmethod
    def copy_of(cls, file: OpenFile, fd: int) -> OpenFile:
        """The same file through ``fd`` (a duplicate of its descriptor), without asking
        the file system anything again."""
        copy = cls.__new__(cls)
        copy.path, copy.fd, copy.identity = file.path, fd, file.identity
        copy.trusted, copy.refs, copy.failed = file.trusted, 0, False
        copy.allowed, copy.owner = file.allowed, file.owner
        return copy

    def check_in_place(self, fd: int | None = None) -> None:
        """Raise :class:`FileChangedError` unless the file is still what its requests
        named: the same size and modification time, still linked (a file deleted, or
        replaced by a rename over its name, is no longer what a loader opening that name
        reads), and within the allowed roots (a file moved out after its grant is not
        warmed on). ``fd``: a descriptor of it to look at (its own by default)."""
        st = os.fstat(self.fd if fd is None else fd)
        if FileIdentity.of(st) != self.identity:
            raise FileChangedError(self.path, "changed while warming")
        name = kernel_name(self.fd)
        # No link left, or its name gone (replaced by a rename while another hard link
        # keeps the inode): a loader opening the name reads another file, or none.
        if st.st_nlink == 0 or name.endswith(" (deleted)"):
            raise FileChangedError(self.path, "was deleted or replaced while warming")
        if self.allowed is not None and not self.allowed(name):
            raise FileChangedError(self.path, f"moved to {_shown(name)}, outside the allowed roots")

    @property
    def size(self) -> int:
        return self.identity.size

    @contextmanager
    def stream(self) -> Iterator[int]:
        """A fresh descriptor for one warm operation, checked to be the same file.

        One open file description per operation is one stream to the storage: its own
        readahead state, and on a network mount its own connection-level sequential
        read, instead of eight workers interleaving on one handle (every read a seek).
        It is opened through ``/proc/self/fd``, which names this very inode: no path a
        user controls is followed. Where that open is refused (a FUSE mount without
        ``allow_other``), a duplicate of the descriptor we hold does the work.
        """
        try:
            fd = os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            fd = os.dup(self.fd)
        try:
            self.check_in_place(fd)
            # Read exactly the planned ranges: kernel readahead would warm neighbours nobody
            # asked for (+57% bytes for 64 KiB spans, research/machine-probes.md 2.3).
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            yield fd
        finally:
            os.close(fd)


def kernel_name(fd: int) -> str:
    """The kernel's name for an open descriptor (``/proc/self/fd/N``)."""
    return os.readlink(f"/proc/self/fd/{fd}")


_RESOLVE_NO_MAGICLINKS, _RESOLVE_NO_SYMLINKS = 0x02, 0x04
_SYS_OPENAT2 = 437  # the same number on every architecture (the generic syscall table)
_O_PATH_FLAGS = _O_PATH | os.O_CLOEXEC


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)


def _open_no_symlinks(path: str) -> int:
    """An ``O_PATH`` descriptor for ``path`` reached through no symlink at all (openat2
    with RESOLVE_NO_SYMLINKS; on kernels before 5.6, realpath then open, a weaker check)."""
    how = _OpenHow(_O_PATH_FLAGS, 0, _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_MAGICLINKS)
    fd = _libc.syscall(_SYS_OPENAT2, -100, os.fsencode(path), ctypes.byref(how), ctypes.sizeof(how))
    if fd >= 0:
        return int(fd)
    err = ctypes.get_errno()
    if err != errno.ENOSYS:
        raise OSError(err, os.strerror(err), path)
    if os.path.realpath(path) != path:
        raise OSError(errno.ELOOP, "reached through a symlink", path)
    return os.open(path, _O_PATH_FLAGS)


def _close_here(fd: int) -> None:
    """Close in this thread (one checking a caller's descriptors: only it waits). A
    flush error leaves the descriptor gone all the same."""
    with contextlib.suppress(OSError):
        os.close(fd)


def _seen_here(name: str, st: os.stat_result) -> bool:
    """Whether the daemon's own view of the file system has this very file at ``name``.

    The kernel names a descriptor from another mount namespace by its path *there*: a user
    who bind-mounts /etc under an allowed root in a namespace of its own would otherwise
    pass the allowed-roots check with /etc/passwd. Out of descriptors, it cannot tell:
    that raises (the refusal names the cause, not another mount namespace)."""
    try:
        here = _open_no_symlinks(name)
    except OSError as exc:
        if exc.errno in (errno.EMFILE, errno.ENFILE):
            raise
        return False
    try:
        seen = os.fstat(here)
    finally:
        os.close(here)
    return (seen.st_dev, seen.st_ino) == (st.st_dev, st.st_ino)


Adopted = tuple[OpenFile, str]  # a shared file, and the kernel's name for one caller's descriptor


class FileTable:
    """Open files by identity, reference-counted by the requests (and grants) using them.

    A shared file's ``path`` is the name its first opener's descriptor had: callers are
    shown their own (``adopt`` returns it), never that one.

    Thread-safe: descriptors are checked and files opened in worker threads (fstat and
    open may block on a network mount) while the event loop releases them.
    """

    def __init__(
        self,
        allow: tuple[str, ...],
        *,
        close: Callable[[int, Hashable, int | None], object] = lambda fd, lane, uid: os.close(fd),
    ) -> None:
        self._roots = tuple(os.path.realpath(root) for root in allow)
        # The operator hears of grants refused because a job sees its checkpoint at
        # another path than the daemon does (once per mount).
        self._advice = MountAdvice(self._roots, _seen_here)
        self._files: dict[FileIdentity, OpenFile] = {}
        self._lock = threading.Lock()
        # How a file's last reference closes it, in the lane of its file system. The
        # daemon closes in threads of its own (daemon/closer.py): a close() on a FUSE
        # mount waits for its server (FLUSH), which a user may run. A descriptor refused
        # or shared while it is checked is closed in the thread checking it: the
        # caller's own (access.py), or a trusted caller's.
        self._close = close

    def _allowed(self, name: str) -> bool:
        return not self._roots or any(
            name == root or name.startswith(root.rstrip("/") + "/") for root in self._roots
        )

    def adopt(self, fd: int, label: str, *, uid: int | None = None) -> Adopted:
        """Take ownership of ``fd``, a descriptor a caller opened itself (its proof that it
        may read the file), and share it by identity; return the file and the kernel's
        name for this caller's descriptor (what this caller is shown: a shared file's
        ``path`` is whoever opened it first). ``label`` names it in refusals (the caller's
        own name for it), ``uid`` the caller (None: the daemon's own user). On any
        refusal ``fd`` is closed."""
        who = "the daemon's user" if uid is None else f"uid {uid}"
        try:
            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
            if flags & _O_PATH or (flags & os.O_ACCMODE) not in (os.O_RDONLY, os.O_RDWR):
                raise AccessDeniedError(
                    f"{label}: the descriptor was not opened for reading (flags {flags:#o}); "
                    "it proves nothing"
                )
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise NotARegularFileError(label, "is not a regular file")
            kernel = kernel_file_system(fd)
            if kernel is not None:
                raise NotARegularFileError(
                    label, f"is on {kernel}: the kernel's interface, no page cache to warm"
                )
            name = kernel_name(fd)
            if not self._allowed(name):
                self._advice.outside(who, name, st)
                raise OutsideAllowedRootsError(
                    label,
                    f"is {_shown(name)}, outside the allowed roots {list(self._roots)}",
                )
            if not _seen_here(name, st):
                if self._roots:
                    self._advice.elsewhere(who, name, st)
                    raise ElsewhereForDaemonError(
                        label,
                        f"is not at {_shown(name)} as the daemon sees the file system (opened "
                        "in another mount namespace, or through a path that changed): the "
                        "allowed roots cannot vouch for it",
                    )
                name += " (elsewhere for the daemon)"  # shown to others: not a name to trust
        except OSError as exc:
            _close_here(fd)
            raise lookup_error(label, exc) from None
        except BaseException:
            _close_here(fd)
            raise
        return self._share(fd, name, FileIdentity.of(st), uid), name

    def acquire(self, path: str) -> Adopted:
        """Open ``path`` with the daemon's own credentials: only for a caller that is the
        daemon's own user (an owner-only socket). The allowed roots are checked on what
        was opened, not on the name: a symlink swapped in between changes nothing."""
        if not path or not os.path.isabs(path):
            raise InvalidRequestError(f"file {_shown(path)}: paths must be absolute")
        if "\0" in path:
            raise InvalidRequestError(f"file {_shown(path)}: a path cannot contain a NUL byte")
        real = os.path.realpath(path)
        if not self._allowed(real):  # refused before it is even stat'ed
            raise OutsideAllowedRootsError(
                path,
                f"resolves to {_shown(real)}, outside the allowed roots {list(self._roots)}",
            )
        try:
            st = os.stat(path)  # a FIFO or a device is stat'ed, never opened
        except OSError as exc:
            raise lookup_error(path, exc) from None
        if not stat.S_ISREG(st.st_mode):
            raise NotARegularFileError(path, "is not a regular file")
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as exc:
            raise lookup_error(path, exc) from None
        return self.adopt(fd, path)

    def close_fd(self, fd: int, uid: int) -> None:
        """Close a descriptor ``uid`` sent that we will not keep, the way files are closed
        (see __init__), in that uid's own lane."""
        self._close(fd, ("uid", uid), uid)

    def _share(self, fd: int, name: str, identity: FileIdentity, uid: int | None) -> OpenFile:
        with self._lock:
            shared = self._files.get(identity)
            if shared is not None:
                shared.refs += 1
            else:
                file = OpenFile(name, fd, identity)
                file.allowed = self._allowed if self._roots else None
                file.owner = uid
                file.refs = 1
                self._files[identity] = file
                return file
        _close_here(fd)  # the same file, open already: this copy is not needed
        return shared

    def release(self, file: OpenFile) -> None:
        with self._lock:
            file.refs -= 1
            if file.refs == 0:
                if self._files.get(file.identity) is file:
                    del self._files[file.identity]
                self._close(file.fd, ("dev", file.identity.device), file.owner)

    def forget(self, file: OpenFile) -> None:
        """Stop handing ``file`` out (it changed under us): a later request for the same
        identity opens it afresh. Its holders still release it, and close it at the end."""
        with self._lock:
            if self._files.get(file.identity) is file:
                del self._files[file.identity]

    def close_all(self) -> None:
        with self._lock:
            for file in self._files.values():
                self._close(file.fd, ("dev", file.identity.device), file.owner)
            self._files.clear()

    def __len__(self) -> int:
        return len(self._files)
