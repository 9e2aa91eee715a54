"""Kernel file systems: files that are the kernel's interfaces, not data to warm.

A regular file on procfs, sysfs, debugfs and their kind has no page cache: reading it
asks the kernel, and the answer can depend on who opened it (sysfs's PCI ``config``
gives 64 bytes to a user and 4096 to root; ``/proc/kcore`` and ``kallsyms`` hide
addresses from others). The daemon reopens each file for a stream of its own, with its
own credentials, so such a file would be read with root's rights for any caller who
could merely open it. They are refused at admission instead: there is nothing there to
warm.
"""

from __future__ import annotations

import ctypes
import os

__all__ = ["kernel_file_system"]

# statfs(2)'s f_type of each (include/uapi/linux/magic.h).
_KERNEL_FILE_SYSTEMS = {
    0x9FA0: "procfs",
    0x62656572: "sysfs",
    0x64626720: "debugfs",
    0x74726163: "tracefs",
    0x73636673: "securityfs",
    0x62656570: "configfs",
    0x27E0EB: "cgroupfs",
    0x63677270: "cgroup2fs",
    0xCAFE4A11: "bpffs",
    0xDE5E81E4: "efivarfs",
    0x6165676C: "pstore",
    0xF97CFF8C: "selinuxfs",
    0x43415D53: "smackfs",
    0x42494E4D: "binfmt_misc",
    0x65735543: "fusectl",
    0x7655821: "resctrl",
    0x6E736673: "nsfs",
    0x1CD1: "devpts",
}

_libc = ctypes.CDLL(None, use_errno=True)


class _Statfs(ctypes.Structure):
    # f_type comes first on every Linux architecture; the rest is room (struct statfs is
    # 120 bytes on 64-bit ones).
    _fields_ = [("f_type", ctypes.c_long), ("rest", ctypes.c_byte * 256)]


def kernel_file_system(fd: int) -> str | None:
    """The name of the kernel file system ``fd``'s file is on (procfs, sysfs, ...), or
    None for any other. Raises OSError where ``fstatfs`` fails."""
    buf = _Statfs()
    if _libc.fstatfs(fd, ctypes.byref(buf)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return _KERNEL_FILE_SYSTEMS.get(buf.f_type & 0xFFFFFFFF)
