"""The node's file table, built alone on real files in tmp_path: descriptors adopted and
shared by identity, refusals for what a caller may not have warmed, references counted."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from spanwarm.daemon.files import FileTable, kernel_name
from spanwarm.errors import (
    AccessDeniedError,
    FileChangedError,
    InvalidRequestError,
    NotARegularFileError,
    OutsideAllowedRootsError,
    ShardMissingError,
)


def _closed(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return True
    return False


def test_one_file_opened_twice_is_shared_by_identity(tmp_path: Path) -> None:
    path = tmp_path / "a.safetensors"
    path.write_bytes(b"x" * 100)
    closed: list[int] = []
    table = FileTable((str(tmp_path),), close=lambda fd, lane, uid: closed.append(fd))
    first, name = table.adopt(os.open(path, os.O_RDONLY), "a", uid=1000)
    second_fd = os.open(path, os.O_RDONLY)
    second, _ = table.adopt(second_fd, "a again", uid=1001)
    assert second is first
    assert _closed(second_fd)  # the copy is not needed
    assert (first.refs, first.size, first.owner, len(table)) == (2, 100, 1000, 1)
    assert name == str(path) == first.path == kernel_name(first.fd)
    table.release(first)
    assert closed == []
    table.release(first)
    assert closed == [first.fd]
    assert len(table) == 0
    os.close(first.fd)


def test_a_descriptor_outside_the_allowed_roots_is_refused_and_closed(tmp_path: Path) -> None:
    (tmp_path / "allowed").mkdir()
    path = tmp_path / "elsewhere"
    path.write_bytes(b"x")
    table = FileTable((str(tmp_path / "allowed"),))
    fd = os.open(path, os.O_RDONLY)
    with pytest.raises(OutsideAllowedRootsError, match="outside the allowed roots"):
        table.adopt(fd, "mine")
    assert _closed(fd)


def test_a_descriptor_not_open_for_reading_proves_nothing(tmp_path: Path) -> None:
    path = tmp_path / "w"
    path.write_bytes(b"x")
    fd = os.open(path, os.O_WRONLY)
    with pytest.raises(AccessDeniedError, match="not opened for reading"):
        FileTable(()).adopt(fd, "w")
    assert _closed(fd)


def test_by_name_only_absolute_regular_existing_files_open(tmp_path: Path) -> None:
    table = FileTable(())
    with pytest.raises(InvalidRequestError, match="absolute"):
        table.acquire("relative/path")
    with pytest.raises(NotARegularFileError, match="not a regular file"):
        table.acquire(str(tmp_path))
    with pytest.raises(ShardMissingError, match="no such file"):
        table.acquire(str(tmp_path / "missing"))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(NotARegularFileError):
        table.acquire(str(fifo))  # stat'ed, never opened: no hang


def test_a_file_changed_under_its_requests_is_no_longer_in_place(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x" * 10)
    table = FileTable(())
    file, _ = table.acquire(str(path))
    file.check_in_place()
    with path.open("ab") as out:
        out.write(b"more")
    with pytest.raises(FileChangedError, match="changed while warming"):
        file.check_in_place()
    table.forget(file)
    assert len(table) == 0
    table.release(file)
