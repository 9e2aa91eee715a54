"""Where the node's daemon listens, and whether that place can be trusted.

Shared by the daemon and its clients. A socket is only as private as the directories
above it: whoever may write one of them can replace the socket with their own (and
listen for what ranks send, or stall them). So both sides refuse a socket whose
directory chain another user controls: a directory owned by someone other than root or
the daemon's user, or one that group or others may write without the sticky bit (with
it, as in /tmp, nobody can rename or remove another user's entries). A client trusts
root, itself, the users named in ``$SPANWARM_DAEMON_USER``, and a system account root
gave the directory to; it refuses a socket owned by anyone else.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pwd
import stat
import tempfile
from pathlib import Path

__all__ = [
    "access_socket_path",
    "daemon_users",
    "default_socket_path",
    "private_directory",
    "trusted_owners",
    "unsafe_directory",
    "unsafe_socket",
]

_ACCESS_SUFFIX = ".access"


def default_socket_path() -> str:
    """``$SPANWARM_SOCKET``, else /run/spanwarm/spanwarm.sock as root, else a per-user path
    (``$XDG_RUNTIME_DIR/spanwarm.sock``, or ``spanwarm-<uid>/spanwarm.sock`` in the temp
    dir: a directory the daemon creates 0700, and both sides verify)."""
    if env := os.environ.get("SPANWARM_SOCKET"):
        return env
    if os.geteuid() == 0:
        return "/run/spanwarm/spanwarm.sock"
    if runtime := os.environ.get("XDG_RUNTIME_DIR"):
        return str(Path(runtime) / "spanwarm.sock")
    return str(Path(tempfile.gettempdir()) / f"spanwarm-{os.geteuid()}" / "spanwarm.sock")


def access_socket_path(socket: str) -> str:
    """The access channel's socket (descriptors and peer credentials), next to ``socket``."""
    return socket + _ACCESS_SUFFIX


def _describe(path: str, st: os.stat_result) -> str:
    return f"{path} (owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o})"


@functools.cache  # read once a process: a client checks its socket on every request
def _system_uid_max() -> int:
    """The highest uid of a system account (``SYS_UID_MAX`` in /etc/login.defs, 999)."""
    try:
        for line in Path("/etc/login.defs").read_text().splitlines():
            fields = line.split()
            if len(fields) == 2 and fields[0] == "SYS_UID_MAX" and fields[1].isdigit():
                return int(fields[1])
    except OSError:
        pass
    return 999


def daemon_users() -> frozenset[int]:
    """Users a client trusts to run the daemon besides root and itself: the uids or names
    in ``$SPANWARM_DAEMON_USER`` (comma-separated; e.g. the image's 10001 in Kubernetes)."""
    uids = set()
    for entry in os.environ.get("SPANWARM_DAEMON_USER", "").split(","):
        entry = entry.strip()
        if entry.isdigit():
            uids.add(int(entry))
        elif entry:
            with contextlib.suppress(KeyError):  # no such user: nobody to trust
                uids.add(pwd.getpwnam(entry).pw_uid)
    return frozenset(uids)


def trusted_owners(
    directory: str, uid: int | None = None, *, delegate: bool = False
) -> tuple[frozenset[int], str | None]:
    """Who may own the sockets in ``directory``, and why nobody should use it (None: it
    is safe). Every directory from the root down is checked: each must be owned by root
    or ``uid`` (by default ours), and none may be writable by group or others without the
    sticky bit. With ``delegate`` (a client's view), a directory may also belong to a
    user from :func:`daemon_users`, or to a system account (uid up to ``SYS_UID_MAX``)
    that root gave it to: its parent is root's and nobody else may write there, as
    systemd's ``RuntimeDirectory=`` makes /run/spanwarm for ``User=spanwarm``. Never a
    regular user's directory: /home/<user> is root's gift too."""
    uid = os.geteuid() if uid is None else uid
    owners = {0, uid}
    named = daemon_users() if delegate else frozenset()
    try:
        real = Path(os.path.realpath(directory))
        chain = [*reversed(real.parents), real]
        parent: os.stat_result | None = None
        for path in chain:
            st = os.stat(path)
            if st.st_uid not in owners:
                given = (
                    parent is not None
                    and parent.st_uid == 0
                    and not parent.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
                )
                system = _system_uid_max() if delegate and given else -1
                if not (st.st_uid in named or (given and 0 < st.st_uid <= system)):
                    return frozenset(), f"{_describe(str(path), st)} belongs to another user"
                owners.add(st.st_uid)
            writable = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
            if writable and not st.st_mode & stat.S_ISVTX:
                return frozenset(), (
                    f"{_describe(str(path), st)} is writable by others without the sticky bit"
                )
            parent = st
    except OSError as exc:
        return frozenset(), f"{directory}: {exc.strerror}"
    return frozenset(owners | named), None


def unsafe_directory(directory: str, uid: int | None = None) -> str | None:
    """Why another user could replace entries of ``directory`` (None: it is safe; see
    :func:`trusted_owners`)."""
    return trusted_owners(directory, uid)[1]


def unsafe_socket(path: str, owners: frozenset[int]) -> str | None:
    """Why a client must not talk to the socket at ``path`` (None: it may): it must be a
    socket, owned by one of ``owners`` (what :func:`trusted_owners` says of its directory,
    as a client sees it)."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        return f"{path}: {exc.strerror}"
    if not stat.S_ISSOCK(st.st_mode):
        return f"{_describe(path, st)} is not a socket"
    if st.st_uid not in owners:
        return f"{_describe(path, st)} belongs to another user"
    return None


def private_directory(directory: str, mode: int) -> str | None:
    """Create ``directory`` (``mode``, parents too) unless it exists, then say why it is not
    safe for our socket (None when it is)."""
    if not os.path.isdir(directory):
        try:
            os.makedirs(directory, mode=mode, exist_ok=True)
            os.chmod(directory, mode)  # makedirs' mode is masked by the umask
        except OSError as exc:
            return f"{directory}: cannot create it: {exc.strerror}"
    return unsafe_directory(directory)
