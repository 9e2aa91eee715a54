"""Who a call comes from, built alone: real grants over an empty file table, and a real
socket-shaped file whose mode says whether the socket is owner-only."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from spanwarm.daemon.authentication import Authentication, StatusCaller
from spanwarm.daemon.files import FileTable
from spanwarm.daemon.grants import Grants, Peer
from spanwarm.errors import UnauthenticatedError


def _auth(tmp_path: Path, *, mode: int = 0o600, group: str | None = None) -> Authentication:
    socket = tmp_path / "spanwarm.sock"
    socket.touch()
    os.chmod(socket, mode)
    grants = Grants(FileTable(()), ttl=60.0, max_per_uid=4, exempt=frozenset({0}))
    return Authentication(grants, socket=str(socket), socket_group=group, trusted={0, 4242})


def test_owner_only_follows_the_sockets_mode_and_group_at_every_call(tmp_path: Path) -> None:
    auth = _auth(tmp_path)
    assert auth.owner_only()
    os.chmod(auth.socket, 0o660)
    assert not auth.owner_only()
    assert not _auth(tmp_path, group="users").owner_only()
    os.unlink(auth.socket)
    assert not auth.owner_only()


def test_a_warm_spends_its_grant_once(tmp_path: Path) -> None:
    auth = _auth(tmp_path, mode=0o666)
    grant = auth.grants.issue(Peer(pid=1, uid=1000, gid=1000), [])
    assert auth.warm_grant(grant.token) is grant
    with pytest.raises(UnauthenticatedError, match="no live grant"):
        auth.warm_grant(grant.token)


def test_a_warm_without_a_token_is_served_on_an_owner_only_socket_only(tmp_path: Path) -> None:
    assert _auth(tmp_path).warm_grant("") is None
    shared = _auth(tmp_path, mode=0o666)
    with pytest.raises(UnauthenticatedError, match=r"Warm needs a token.*\.sock\.access"):
        shared.warm_grant("")


def test_consumed_needs_the_token_its_requests_warm_spent(tmp_path: Path) -> None:
    auth = _auth(tmp_path)
    assert auth.may_consume("abc", "abc")
    assert not auth.may_consume("abc", "abd")
    assert not auth.may_consume("abc", "")
    assert auth.may_consume("", "")  # admitted by name, on an owner-only socket
    assert not auth.may_consume("", "abc")
    os.chmod(auth.socket, 0o666)
    assert not auth.may_consume("", "")


def test_status_shows_a_token_its_uid_and_trusted_uids_everything(tmp_path: Path) -> None:
    auth = _auth(tmp_path, mode=0o666)
    user = auth.grants.issue(Peer(pid=1, uid=1000, gid=1000), [])
    daemon = auth.grants.issue(Peer(pid=2, uid=4242, gid=4242), [])
    assert auth.status_caller(user.token) == StatusCaller(1000, False)
    assert auth.status_caller(daemon.token) == StatusCaller(4242, True)
    assert auth.status_caller("") == StatusCaller(None, False)
    assert _auth(tmp_path).status_caller("") == StatusCaller(None, True)
    with pytest.raises(UnauthenticatedError, match="no live token"):
        auth.status_caller("not-a-token")
