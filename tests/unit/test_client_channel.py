"""The rank's channel to its daemon: never opened to a socket it may not trust.

Real sockets bound in tmp_path (nothing listens on them) and real directories: the
checks run before any byte is sent, so no daemon is needed to see them refuse.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from spanwarm.client.access import EndpointUnsafe
from spanwarm.client.channel import CHANNEL_OPTIONS, MAX_MESSAGE, DaemonChannel
from spanwarm.endpoint import access_socket_path


@pytest.fixture
def bound(tmp_path: Path) -> Iterator[str]:
    """A daemon's two sockets, bound in a private directory, with nobody listening."""
    directory = tmp_path / "run"
    directory.mkdir(mode=0o700)
    path = str(directory / "spanwarm.sock")
    grpc_socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    access = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        grpc_socket.bind(path)
        access.bind(access_socket_path(path))
        yield path
    finally:
        grpc_socket.close()
        access.close()


def test_no_daemon_there_opens_nothing(tmp_path: Path) -> None:
    channel = DaemonChannel(str(tmp_path / "missing" / "spanwarm.sock"), timeout=1.0)
    with pytest.raises(FileNotFoundError):
        channel.stub()
    assert not channel.open
    channel = DaemonChannel(str(tmp_path / "spanwarm.sock"), timeout=1.0)  # directory there
    with pytest.raises(FileNotFoundError):
        channel.stub()
    assert not channel.open


def test_a_socket_in_a_directory_others_may_write_is_never_used(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # no sticky bit: anyone could have replaced the socket
    channel = DaemonChannel(str(shared / "spanwarm.sock"), timeout=1.0)
    with pytest.raises(EndpointUnsafe, match="writable by others"):
        channel.stub()
    assert not channel.open


def test_a_file_where_the_socket_should_be_is_never_used(tmp_path: Path) -> None:
    directory = tmp_path / "run"
    directory.mkdir(mode=0o700)
    (directory / "spanwarm.sock").write_bytes(b"")
    channel = DaemonChannel(str(directory / "spanwarm.sock"), timeout=1.0)
    with pytest.raises(EndpointUnsafe, match="not a socket"):
        channel.stub()
    assert not channel.open


def test_a_trusted_socket_gets_one_channel_until_closed(bound: str) -> None:
    channel = DaemonChannel(bound, timeout=1.0)
    assert channel.stub() is not None
    assert channel.open is True
    channel.stub()  # the same channel, not another
    channel.close()
    assert (channel.open,) == (False,)
    channel.close()  # twice: nothing to do
    channel.stub()  # reopened on the next call
    assert (channel.open,) == (True,)
    channel.close()


def test_a_grant_with_nobody_listening_fails_as_unreachable(bound: str) -> None:
    channel = DaemonChannel(bound, timeout=1.0)
    with pytest.raises(ConnectionRefusedError):
        channel.grant([])


def test_status_with_nobody_listening_is_unavailable(bound: str) -> None:
    channel = DaemonChannel(bound, timeout=2.0)
    try:
        with pytest.raises(grpc.RpcError) as raised:
            channel.status()
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        channel.close()


def test_a_frozen_daemon_is_noticed_before_a_load_would_stall() -> None:
    """A ping every 10 s, given up on 5 s later: 15 s, under the 30 s stall timeout; and
    messages large enough for a request of a million spans as columns."""
    options = dict(CHANNEL_OPTIONS)
    noticed_ms = options["grpc.keepalive_time_ms"] + options["grpc.keepalive_timeout_ms"]
    assert noticed_ms <= 15_000
    assert options["grpc.http2.ping_timeout_ms"] <= options["grpc.keepalive_timeout_ms"]
    assert options["grpc.keepalive_permit_without_calls"] == 1
    assert options["grpc.max_send_message_length"] == MAX_MESSAGE >= 64 * 2**20
