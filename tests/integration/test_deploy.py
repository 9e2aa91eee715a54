"""deploy/: the systemd unit verifies and starts the daemon as it says; manifests are sane."""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from spanwarm.daemon.config import settings

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
SPANWARM = Path(sys.executable).parent / "spanwarm"


def unit() -> dict[str, list[str]]:
    entries: dict[str, list[str]] = {}
    for line in (DEPLOY / "systemd" / "spanwarm.service").read_text().splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, value = line.split("=", 1)
            entries.setdefault(key, []).append(value)
    return entries


def test_unit_declares_what_operators_rely_on() -> None:
    entries = unit()
    assert entries["Type"] == ["notify"]
    assert entries["RuntimeDirectory"] == ["spanwarm"]
    assert entries["User"] == ["spanwarm"]
    assert entries["NoNewPrivileges"] == ["yes"]
    assert entries["CapabilityBoundingSet"] == [""]
    assert entries["ProtectSystem"] == ["strict"]
    assert entries["EnvironmentFile"] == ["-/etc/spanwarm/spanwarm.env"]
    assert entries["Nice"] == ["-5"]  # Status before the ranks' start-up on a busy node


def test_systemd_analyze_verify(tmp_path: Path) -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    text = (DEPLOY / "systemd" / "spanwarm.service").read_text()
    copy = tmp_path / "spanwarm.service"
    copy.write_text(text.replace("/usr/local/bin/spanwarm", str(SPANWARM)))
    result = subprocess.run(
        ["systemd-analyze", "verify", str(copy)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr


def test_env_file_names_every_setting() -> None:
    text = (DEPLOY / "systemd" / "spanwarm.env").read_text()
    for name, _, _ in settings():
        if name not in (
            "socket",
            "throttle_bytes_per_s",
        ):  # the unit sets the socket; throttle is for tests
            assert f"SPANWARM_{name.upper()}=" in text, name


def test_daemon_starts_as_the_unit_says_and_notifies(tmp_path: Path) -> None:
    (exec_start,) = unit()["ExecStart"]
    argv = shlex.split(exec_start)
    assert argv[0] == "/usr/local/bin/spanwarm"
    assert argv[1:3] == ["serve", "--socket"]
    directory = tempfile.mkdtemp(prefix="sw-unit-")  # stands in for RuntimeDirectory
    try:
        argv = [str(SPANWARM), *argv[1:3], os.path.join(directory, "spanwarm.sock"), *argv[4:]]
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        notify.bind(os.path.join(directory, "notify"))
        notify.settimeout(30)
        env = {**os.environ, "NOTIFY_SOCKET": os.path.join(directory, "notify")}
        process = subprocess.Popen(argv, env=env)
        try:
            assert notify.recv(64) == b"READY=1"
        finally:
            process.terminate()
            assert process.wait(30) == 0
            notify.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def manifests(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((DEPLOY / "kubernetes" / name).read_text()) if d]


def test_daemonset_shares_the_socket_and_mounts_checkpoints_read_only() -> None:
    (daemonset,) = manifests("daemonset.yaml")
    assert daemonset["kind"] == "DaemonSet"
    pod = daemonset["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert volumes["socket-dir"]["hostPath"]["path"] == "/run/spanwarm"
    assert mounts["socket-dir"]["mountPath"] == "/run/spanwarm"
    assert mounts["checkpoints"]["readOnly"] is True
    assert "--allow" in container["args"]
    assert {"name": "SPANWARM_SOCKET", "value": "/run/spanwarm/spanwarm.sock"} in container["env"]
    assert "memory" in container["resources"]["limits"]
    assert container["readinessProbe"]["exec"]["command"][:2] == ["spanwarm", "status"]
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True


def test_daemon_and_jobs_see_the_checkpoints_at_the_same_path() -> None:
    """--allow is checked on the path a rank opened each file at: the daemon must mount the
    checkpoints where the node and the job pods have them (tests/container runs it)."""
    (daemonset,) = manifests("daemonset.yaml")
    pod = daemonset["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    host = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["checkpoints"] == host["checkpoints"]
    args = container["args"]
    assert args[args.index("--allow") + 1] == host["checkpoints"]
    readme = (DEPLOY / "kubernetes" / "README.md").read_text()
    assert f"mountPath: {host['checkpoints']}, readOnly: true" in readme  # the job pod's
    (sidecar_pod,) = manifests("sidecar-pod.yaml")
    _, sidecar = sidecar_pod["spec"]["initContainers"]
    (trainer,) = sidecar_pod["spec"]["containers"]
    at = {m["name"]: m["mountPath"] for m in sidecar["volumeMounts"]}["checkpoints"]
    assert at == {m["name"]: m["mountPath"] for m in trainer["volumeMounts"]}["checkpoints"]
    assert sidecar["args"][sidecar["args"].index("--allow") + 1] == at


def test_sidecar_is_a_native_sidecar_sharing_the_socket() -> None:
    (pod,) = manifests("sidecar-pod.yaml")
    prepare, sidecar = pod["spec"]["initContainers"]
    assert prepare["command"] == ["chmod", "1777", "/run/spanwarm"]  # sticky, as /tmp
    assert sidecar["restartPolicy"] == "Always"
    trainer = pod["spec"]["containers"][0]
    socket_env = {"name": "SPANWARM_SOCKET", "value": "/run/spanwarm/spanwarm.sock"}
    assert socket_env in sidecar["env"]
    assert socket_env in trainer["env"]
    shared = {m["mountPath"] for m in sidecar["volumeMounts"]} & {
        m["mountPath"] for m in trainer["volumeMounts"]
    }
    assert "/run/spanwarm" in shared


def test_container_image_has_no_torch_and_runs_unprivileged() -> None:
    text = (DEPLOY / "container" / "Containerfile").read_text()
    assert "torch" not in text.lower().replace("no torch", "")
    assert "USER 10001" in text
    assert 'ENTRYPOINT ["spanwarm", "serve"]' in text
