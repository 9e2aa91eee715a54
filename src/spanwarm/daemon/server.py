"""The daemon's lifecycle: bind, serve, drain on SIGTERM within a bound, shut down.

The Unix sockets (the gRPC socket's front door, and the access channel beside it) are
created under a restrictive umask, so they are never more open than 0600 (0660 once
handed to ``--socket-group``), in a directory no other user controls (else the daemon
refuses to start: exit 2); gRPC itself listens behind the door, in a 0700 directory
(:mod:`spanwarm.daemon.front_door`). ``--listen`` is a second gRPC server on loopback
TCP with the health service only: TCP cannot say who is calling. The gRPC health service
goes NOT_SERVING first on shutdown, open streams get ``drain_seconds`` to finish, then the
server stops (1 s grace) and the node closes without waiting for warm operations still
running: a read hung in the storage cannot hold the exit, which comes within
``drain_seconds`` + 2 s with status 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import logging
import os
import resource
import signal
import socket
import stat
import sys
from collections.abc import Callable
from typing import NoReturn

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from spanwarm.daemon.access import AccessServer
from spanwarm.daemon.config import DaemonConfig
from spanwarm.daemon.front_door import GRPC_OPTIONS, FrontDoor, prepare_inner_directory
from spanwarm.daemon.grants import Grants
from spanwarm.daemon.heap import configure_heap
from spanwarm.daemon.node import Node
from spanwarm.daemon.notify import notify
from spanwarm.daemon.service import WarmerService
from spanwarm.daemon.wire import WARMER
from spanwarm.endpoint import access_socket_path, private_directory
from spanwarm.errors import SpanwarmError

__all__ = ["StartupError", "run", "serve"]

logger = logging.getLogger("spanwarm.daemon")

MAX_MESSAGE = 128 * 2**20  # a 4M-span request is ~52 MB: room for long names, no more
# Clients ping every 10 s to notice a frozen daemon (spanwarm.client); accept that
# rather than answering with GOAWAY "too_many_pings" (the default wants 5 min).
_KEEPALIVE_OPTIONS = [
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.keepalive_permit_without_calls", 1),
]


class StartupError(SpanwarmError):
    """The daemon cannot start: one line says why."""


class UnsafeSocketError(StartupError):
    """The socket's place is controlled by another user (exit status 2)."""


def _prepare_socket_path(path: str) -> None:
    """Create the socket's directory (0755 as root: group members must reach the socket;
    0700 otherwise), refuse one another user controls, refuse a live daemon, clear a
    stale socket."""
    parent = os.path.dirname(os.path.abspath(path))
    if reason := private_directory(parent, 0o755 if os.geteuid() == 0 else 0o700):
        raise UnsafeSocketError(f"refusing to serve in {parent}: {reason}")
    for name in (path, access_socket_path(path)):
        if not os.path.lexists(name):
            continue
        st = os.lstat(name)
        if not stat.S_ISSOCK(st.st_mode):
            raise StartupError(f"{name} exists and is not a socket; refusing to replace it")
        if st.st_uid not in (0, os.geteuid()):
            raise UnsafeSocketError(
                f"refusing to serve on {name}: it belongs to uid {st.st_uid} "
                f"(mode {stat.S_IMODE(st.st_mode):04o})"
            )
    if not os.path.lexists(path):
        return
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            os.unlink(path)  # left behind by a daemon that died
            return
    raise StartupError(f"another daemon is already serving on {path}")


def _open_to_group(paths: tuple[str, ...], group: str) -> None:
    try:  # a number need not be named in the daemon's /etc/group (a container's, say)
        gid = int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
    except KeyError:
        raise StartupError(f"--socket-group {group!r}: no such group") from None
    for path in paths:
        os.chown(path, -1, gid)
        os.chmod(path, 0o660)


async def serve(config: DaemonConfig, *, on_ready: Callable[[], None] | None = None) -> int:
    """Serve until SIGTERM or SIGINT; return the exit status."""
    _prepare_socket_path(config.socket)
    node = Node(config)
    # The helpers' interpreters start while the rest starts (a few tenths of a second).
    helpers = asyncio.get_running_loop().run_in_executor(None, node.helpers.start)
    grants = Grants(
        node.files,
        ttl=config.grant_seconds,
        max_per_uid=config.user_max_requests,
        exempt=node.trusted_uids,
    )
    access = AccessServer(
        access_socket_path(config.socket),
        node.files,
        grants,
        max_files=config.max_files,
        user_max_files=config.user_max_files,
        trusted=node.trusted_uids,
        stream_rate=node.throughput.bytes_per_s,
        refused=node.refused,
        closer=node.closer,
    )
    options = [
        ("grpc.max_receive_message_length", MAX_MESSAGE),
        ("grpc.max_send_message_length", MAX_MESSAGE),
        *_KEEPALIVE_OPTIONS,
    ]
    server = grpc.aio.server(options=[*options, *GRPC_OPTIONS])
    service = WarmerService(node, config, grants)
    server.add_generic_rpc_handlers([service.handler()])
    health_service = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_service, server)
    reflection.enable_server_reflection(
        (WARMER, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    probes = None
    if config.listen:  # health only: anyone on the host can reach a TCP port
        probes = grpc.aio.server(options=options)
        health_pb2_grpc.add_HealthServicer_to_server(health_service, probes)
        if not probes.add_insecure_port(config.listen):
            raise StartupError(f"cannot listen on {config.listen}")

    try:
        inner = prepare_inner_directory(config.socket)
    except OSError as exc:
        raise StartupError(f"cannot make the inner socket's directory: {exc}") from None
    previous = os.umask(0o177)  # the socket is born 0600: no window between bind and chmod
    try:
        if not server.add_insecure_port(f"unix:{inner}"):
            raise StartupError(f"cannot bind {inner}")
        await server.start()
    finally:
        os.umask(previous)
    door = FrontDoor(config.socket, inner, trusted=node.trusted_uids, refused=node.refused)
    door.start()
    access.start()
    if probes is not None:
        await probes.start()
    if config.socket_group:
        _open_to_group((config.socket, access.path), config.socket_group)
    if config.metrics:
        node.metrics.serve(config.metrics)
    node.start()
    try:
        await helpers
    except Exception:  # they start with the first large request instead
        logger.warning("could not start the helper processes", exc_info=True)
    expiry = asyncio.get_running_loop().create_task(_expire_grants(grants), name="grants")
    for name in ("", WARMER):
        await health_service.set(name, health_pb2.HealthCheckResponse.SERVING)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    logger.info(
        "serving on %s%s (method %s, %d workers, allowed roots: %s)",
        config.socket,
        f" and {config.listen}" if config.listen else "",
        node.method,
        config.workers,
        ", ".join(config.allow) or "any",
    )
    notify("READY=1")
    if on_ready is not None:
        on_ready()
    await stop.wait()

    notify("STOPPING=1")
    logger.info(
        "shutting down: draining %d streams for up to %.1f s", service.streams, config.drain_seconds
    )
    await health_service.enter_graceful_shutdown()
    service.draining = True
    service.stopping.set()  # streams only waiting for ranks to report reads may end now
    try:
        if service.streams:
            await asyncio.wait_for(service.idle.wait(), config.drain_seconds)
    except TimeoutError:
        logger.warning(
            "%d streams still open after %.1f s; cancelling them",
            service.streams,
            config.drain_seconds,
        )
    await access.close()
    await asyncio.gather(
        server.stop(grace=1.0), *(() if probes is None else (probes.stop(grace=1.0),))
    )
    door.close()
    expiry.cancel()
    grants.close()
    await node.close()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(config.socket)
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.remove_signal_handler(signum)
    logger.info("stopped")
    return 0


async def _expire_grants(grants: Grants) -> None:
    while True:
        await asyncio.sleep(1.0)
        grants.expire()


def run(config: DaemonConfig) -> NoReturn:
    """Run the daemon on uvloop when it is installed, plain asyncio otherwise; exit the
    process with its status once it has stopped."""
    # Admission and planning threads run numpy and protobuf code that holds the GIL; the
    # event loop waits for it between every step of an RPC. A 1 ms switch interval (5 ms
    # by default) keeps Status fast while 64 ranks are admitted.
    sys.setswitchinterval(0.001)
    # Every file a live request names stays open: take all the descriptors we may have.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    try:
        import uvloop

        loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
    except ImportError:
        loop_factory = None
    configure_heap()
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        status = runner.run(serve(config))
    # Served and stopped cleanly (state saved, socket gone, descriptors closed): leave
    # without the interpreter's teardown. grpc's C-core threads still running during it
    # abort the process (SIGABRT, "terminate called without an active exception") in
    # 5 of 40 stops whose ranks go away as SIGTERM comes (scripts/stop_repeatedly.py),
    # which systemd records as a crash; and a worker hung in a read has nothing to finish.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
