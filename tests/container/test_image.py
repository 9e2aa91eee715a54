"""The daemon image, built and run as deploy/kubernetes/daemonset.yaml runs it, serving a
rank process on the host.

The image comes from ``deploy/container/build-local.sh`` (Debian's packages and the
project's wheels: nothing from a container registry) and is kept in podman's storage,
tagged by a hash of everything that goes into it, so only the first run after a change
builds it. The container runs as the DaemonSet's user and group (10001:10001), with a
read-only root file system, no capabilities, its own network namespace, the socket
directory and the checkpoint directory bind-mounted from the host, the checkpoint at the
same path as the ranks see it (deploy/kubernetes/README.md). A rank on the host, another
uid in the socket's group, hands the daemon its descriptors through the mounted socket.

Skipped where podman, mmdebstrap and runc are missing (``make test`` installs them as
root) or no Debian mirror can be reached to make the base.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from spanwarm.pagecache.residency import resident_bytes
from tests.daemon_harness import cold_file

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "deploy" / "container" / "build-local.sh"
DAEMONSET = ROOT / "deploy" / "kubernetes" / "daemonset.yaml"
REPOSITORY = "localhost/spanwarm-test"
DAEMON = 10001  # the DaemonSet's runAsUser, runAsGroup and the image's group `spanwarm`
RANK = 10002  # a job's user on the host, in the socket's group
DRAIN_S = 10  # the daemon's default --drain-seconds
MiB = 2**20

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: podman's storage, mmdebstrap"),
    pytest.mark.skipif(
        not all(shutil.which(tool) for tool in ("podman", "mmdebstrap", "runc")),
        reason="needs podman, mmdebstrap and runc (make test installs them as root with apt)",
    ),
    pytest.mark.timeout(900),  # a fresh machine builds the base and the image first
]


def _podman() -> list[str]:
    """podman with this host's options, as build-local.sh chooses them."""
    hybrid = not os.path.exists("/sys/fs/cgroup/cgroup.controllers")  # not cgroup2 alone
    return ["podman", *(["--runtime", "runc", "--cgroup-manager", "cgroupfs"] if hybrid else [])]


def _ulimits() -> list[str]:
    _, files = resource.getrlimit(resource.RLIMIT_NOFILE)
    return ["--ulimit", f"nofile={files}:{files}", "--ulimit", "nproc=4096:4096"]


def _key() -> str:
    """A hash of what goes into the image: the recipe, the sources, the wheels' versions."""
    digest = hashlib.sha256()
    listed = subprocess.run(
        [
            "git",
            "ls-files",
            "-co",
            "--exclude-standard",
            "pyproject.toml",
            "README.md",
            "src",
            "deploy/container",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for name in sorted(listed):
        path = ROOT / name
        if path.is_file():
            digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    freeze = subprocess.run(
        [sys.executable, "-m", "pip", "freeze", "--exclude-editable"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    digest.update(freeze.encode())
    return digest.hexdigest()[:16]


@pytest.fixture(scope="module")
def image() -> str:
    tag = f"{REPOSITORY}:{_key()}"
    exists = subprocess.run([*_podman(), "image", "exists", tag], check=False)
    if exists.returncode != 0:
        start = time.monotonic()
        built = subprocess.run(
            [str(BUILD), tag],
            capture_output=True,
            text=True,
            check=False,
            env={**os.environ, "PYTHON": sys.executable},
        )
        if built.returncode == 3:
            pytest.skip(f"no base image could be made here: {built.stderr.strip()[-500:]}")
        assert built.returncode == 0, built.stderr[-4000:]
        print(f"built {tag} in {time.monotonic() - start:.1f} s", file=sys.stderr)
        # Keep one test image: the one just built.
        listed = subprocess.run(
            [*_podman(), "images", "--format", "{{.Repository}}:{{.Tag}}", REPOSITORY],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        stale = [name for name in listed if name != tag]
        if stale:
            subprocess.run([*_podman(), "rmi", *stale], capture_output=True, check=False)
    return tag


class Node:
    """The host's side: the socket directory and the checkpoint, as the DaemonSet's
    hostPath volumes are."""

    def __init__(self) -> None:
        # Owned by the daemon's user, written by nobody else, in root's /run: what the
        # node's systemd-tmpfiles line makes of /run/spanwarm.
        self.sockets = Path(tempfile.mkdtemp(prefix="spanwarm-test-", dir="/run"))
        self.sockets.chmod(0o755)
        os.chown(self.sockets, DAEMON, DAEMON)
        self.socket = str(self.sockets / "spanwarm.sock")
        self.top = Path(tempfile.mkdtemp(prefix="swct-", dir="/var/tmp"))
        self.top.chmod(0o755)
        self.checkpoints = self.top / "checkpoints"
        (self.checkpoints / "model").mkdir(parents=True, mode=0o755)
        self.shard = cold_file(self.checkpoints / "model" / "model-00001.safetensors", 24 * MiB)
        self.shard.chmod(0o644)
        # The daemon's state (what it learned of each mount), the node's /var/lib/spanwarm.
        self.state = self.top / "state"
        self.state.mkdir(mode=0o700)
        os.chown(self.state, DAEMON, DAEMON)

    def close(self) -> None:
        shutil.rmtree(self.sockets, ignore_errors=True)
        shutil.rmtree(self.top, ignore_errors=True)


@pytest.fixture
def node() -> Iterator[Node]:
    n = Node()
    try:
        yield n
    finally:
        n.close()


def _status(container: str) -> dict[str, Any]:
    """`spanwarm status --json` in the container, as the daemon's user (the probe's way)."""
    out = subprocess.run(
        [*_podman(), "exec", container, "spanwarm", "status", "--json"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return dict(json.loads(out))


def _as_the_daemonset(node: Node, checkpoints_at: str | None) -> list[str]:
    """`podman run` options and the daemon's arguments from daemonset.yaml: its user and
    group, read-only root, no capabilities, env, args, and hostPath volumes with the
    node's directories here in place of the manifest's. The checkpoints go where the
    manifest mounts them (the node's path, as for the ranks) unless ``checkpoints_at``."""
    (daemonset,) = [d for d in yaml.safe_load_all(DAEMONSET.read_text()) if d]
    pod = daemonset["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    user, group = pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"]
    assert (user, group) == (DAEMON, DAEMON)
    here = {"socket-dir": node.sockets, "checkpoints": node.checkpoints, "state": node.state}
    hosts = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"]}
    rename = {hosts["checkpoints"]: str(checkpoints_at or node.checkpoints)}
    options = ["--user", f"{user}:{group}", "--cap-drop", "ALL"]
    if container["securityContext"]["readOnlyRootFilesystem"]:
        options.append("--read-only")
    if not container["securityContext"]["allowPrivilegeEscalation"]:
        options += ["--security-opt", "no-new-privileges"]
    for mount in container["volumeMounts"]:
        at = rename.get(mount["mountPath"], mount["mountPath"])
        mode = ":ro" if mount.get("readOnly") else ""
        options += ["--volume", f"{here[mount['name']]}:{at}{mode}"]
    for env in container["env"]:
        value = "4" if env["name"] == "SPANWARM_WORKERS" else env["value"]  # two cores here
        options += ["--env", f"{env['name']}={value}"]
    return [*options, "--", *(rename.get(a, a) for a in container["args"])]


@contextlib.contextmanager
def daemon(
    image: str, node: Node, checkpoints_at: str | None = None
) -> Iterator[tuple[str, float]]:
    """The container as the DaemonSet runs it (in a network namespace of its own, as a
    pod); (its name, seconds from `podman run` to a Status answered on the mounted
    socket)."""
    name = f"spanwarm-test-{os.getpid()}-{time.monotonic_ns()}"
    options, args = _split(_as_the_daemonset(node, checkpoints_at))
    start = time.monotonic()
    subprocess.run(
        [
            *_podman(),
            "run",
            "--detach",
            "--name",
            name,
            *_ulimits(),
            "--network",
            "none",
            *options,
            image,
            *args,
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    try:
        ready = _wait_ready(name, node, start)
        yield name, ready
    finally:
        subprocess.run([*_podman(), "rm", "--force", "--time", "0", name], capture_output=True)


def _split(words: list[str]) -> tuple[list[str], list[str]]:
    i = words.index("--")
    return words[:i], words[i + 1 :]


def _wait_ready(name: str, node: Node, start: float) -> float:
    """Seconds until the daemon answers Status on the host's side of the socket."""
    from spanwarm.client import Client

    os.environ["SPANWARM_DAEMON_USER"] = str(DAEMON)  # whom a client may trust (the pods' env)
    deadline = start + 60
    while time.monotonic() < deadline:
        if os.path.exists(node.socket):
            client = Client(node.socket, timeout=2.0)
            try:
                client.status()
                return time.monotonic() - start
            except Exception:
                pass
            finally:
                client.close()
        time.sleep(0.05)
    logs = subprocess.run([*_podman(), "logs", name], capture_output=True, text=True).stderr
    raise AssertionError(f"the daemon was not ready within 60 s: {logs[-2000:]}")


def _rank(node: Node, tensors: list[tuple[str, int, int]]) -> dict[str, Any]:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.container.host_rank",
            str(RANK),
            str(RANK),
            str(DAEMON),
            json.dumps({"socket": node.socket, "tensors": tensors}),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=ROOT,
        env={**os.environ, "SPANWARM_SOCKET": node.socket, "SPANWARM_DAEMON_USER": str(DAEMON)},
    )
    assert result.returncode == 0, result.stderr
    return {**json.loads(result.stdout.strip().splitlines()[-1]), "log": result.stderr}


def _warnings(container: str) -> list[str]:
    """The messages of the daemon's log records at WARNING and above (JSON lines)."""
    logs = subprocess.run(
        [*_podman(), "logs", container], capture_output=True, text=True, check=True
    )
    records = [
        json.loads(line)
        for line in (logs.stdout + logs.stderr).splitlines()
        if line.startswith("{")
    ]
    return [r["msg"] for r in records if r["level"] not in ("debug", "info")]


def _in_container(container: str, code: str) -> str:
    return subprocess.run(
        [*_podman(), "exec", container, "python", "-c", code],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


HEALTH_AND_TORCH = """
import importlib.util, grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
with grpc.insecure_channel("127.0.0.1:7070") as channel:
    health = health_pb2_grpc.HealthStub(channel)
    serving = health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
    try:
        from grpc_reflection.v1alpha import reflection_pb2_grpc, reflection_pb2
        list(reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5))
        reflection = "served"
    except grpc.RpcError as exc:
        reflection = exc.code().name
print(health_pb2.HealthCheckResponse.ServingStatus.Name(serving), reflection,
      importlib.util.find_spec("torch") is None)
"""


def test_the_image_serves_ranks_on_the_host_as_the_daemonset_runs_it(
    image: str, node: Node
) -> None:
    spans = [(str(node.shard), 0, 4 * MiB), (str(node.shard), 12 * MiB, 8 * MiB)]
    with daemon(image, node) as (container, ready_s):
        print(f"start to first READY: {ready_s:.2f} s", file=sys.stderr)
        user = subprocess.run(
            [*_podman(), "exec", container, "id", "-u"], capture_output=True, text=True, check=True
        ).stdout.strip()
        # Health on TCP, and nothing else there (no reflection, no Warmer); no torch.
        assert _in_container(container, HEALTH_AND_TORCH) == "SERVING UNIMPLEMENTED True"
        rank = _rank(node, spans)
        fd = os.open(node.shard, os.O_RDONLY)
        try:
            resident = sum(resident_bytes(fd, offset, length) for _, offset, length in spans)
        finally:
            os.close(fd)
        status = _status(container)
        warnings = _warnings(container)
        stop = time.monotonic()
        subprocess.run(
            [*_podman(), "stop", "--time", "30", container], check=True, capture_output=True
        )
        stopped_s = time.monotonic() - stop
        state = json.loads(
            subprocess.run(
                [*_podman(), "inspect", "--format", "{{json .State}}", container],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        )
    assert user == str(DAEMON)
    assert warnings == []
    assert rank["finished"], rank
    assert rank["ready"] == rank["groups"] == 2, rank
    assert resident >= 12 * MiB * 0.99, resident  # warm, as the rank was told
    assert status["bytes_read_total"] + status["bytes_verified_total"] >= 12 * MiB
    assert status["refusals"] == []
    # SIGTERM: drained and gone within --drain-seconds (+2 s), exit status 0, socket removed.
    print(f"stopped in {stopped_s:.2f} s", file=sys.stderr)
    assert stopped_s < DRAIN_S + 2, stopped_s
    assert state["ExitCode"] == 0, state
    assert not os.path.exists(node.socket)


def test_a_checkpoint_mounted_at_another_path_in_the_daemon_is_named_in_its_log(
    image: str, node: Node
) -> None:
    """The mistake the DaemonSet once made (hostPath /mnt/checkpoints at /checkpoints):
    every grant is refused, and now the operator sees why, in the daemon's log and in
    `spanwarm status`, not only in the ranks' logs."""
    with daemon(image, node, "/checkpoints") as (container, _):
        rank = _rank(node, [(str(node.shard), 0, 4 * MiB)])
        again = _rank(node, [(str(node.shard), 8 * MiB, 4 * MiB)])
        status = _status(container)
        warnings = _warnings(container)
    assert rank["ready"] == again["ready"] == 0
    assert "outside the allowed roots ['/checkpoints']" in rank["log"]
    assert status["refusals"] == [{"cause": "outside_allowed_roots", "count": 2}]
    assert len(warnings) == 1, warnings  # once per mount
    (warning,) = warnings
    assert repr(str(node.shard)) in warning  # the path the job used
    assert "'/checkpoints/model/model-00001.safetensors'" in warning  # where the daemon has it
    assert f"The job has the checkpoint at {str(node.checkpoints)!r}" in warning
    assert "and the daemon at '/checkpoints'" in warning
