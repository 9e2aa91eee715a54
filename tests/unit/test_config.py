from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from spanwarm.daemon.config import ConfigError, env_name, load_config, settings

ROOT = Path(__file__).resolve().parents[2]


def test_flags_beat_environment_beat_file_beat_defaults(tmp_path: Path) -> None:
    toml = tmp_path / "spanwarm.toml"
    toml.write_text('workers = 3\nseek_cost = "1MiB"\ndrain_seconds = 2.5\nallow = ["/a", "/b"]\n')
    env = {"SPANWARM_WORKERS": "5", "SPANWARM_SOCKET": "/tmp/x.sock"}
    config = load_config({"workers": "7"}, env=env, path=str(toml))
    assert config.workers == 7  # flag
    assert config.socket == "/tmp/x.sock"  # environment
    assert (config.seek_cost, config.drain_seconds, config.allow) == (
        2**20,
        2.5,
        ("/a", "/b"),
    )  # file
    assert config.chunk_bytes == 8 * 2**20  # default
    assert load_config({}, env=env, path=str(toml)).workers == 5
    assert load_config({}, env={"SPANWARM_SOCKET": "/s"}, path=str(toml)).workers == 3


def test_environment_lists_and_sizes() -> None:
    env = {"SPANWARM_ALLOW": "/x:/y", "SPANWARM_CHUNK_BYTES": "4MiB", "SPANWARM_SOCKET": "/s"}
    config = load_config({}, env=env)
    assert config.allow == ("/x", "/y")
    assert config.chunk_bytes == 4 * 2**20


@pytest.mark.parametrize(
    ("document", "env", "flags", "message"),
    [
        ("colour = 'red'\n", {}, {}, "spanwarm.toml: unknown key 'colour'"),
        ("workers = 'many'\n", {}, {}, "spanwarm.toml: workers: 'many': expected an integer"),
        ("workers = [\n", {}, {}, "spanwarm.toml: not TOML"),
        (
            "",
            {"SPANWARM_SEEK_COST": "12 parsecs"},
            {},
            "SPANWARM_SEEK_COST: seek_cost: '12 parsecs'",
        ),
        (
            "",
            {},
            {"method": "telepathy"},
            "--method: method: 'telepathy': expected one of populate",
        ),
        ("", {}, {"workers": "0"}, "workers: must be >= 1"),
        ("", {}, {"listen": "0.0.0.0:80"}, "must be a loopback address"),
    ],
)
def test_bad_settings_name_their_source(
    tmp_path: Path, document: str, env: dict[str, str], flags: dict[str, str], message: str
) -> None:
    toml = tmp_path / "spanwarm.toml"
    toml.write_text(document)
    with pytest.raises(ConfigError) as info:
        load_config(flags, env={"SPANWARM_SOCKET": "/s", **env}, path=str(toml))
    assert message in str(info.value)


def test_every_setting_is_documented() -> None:
    doc = (ROOT / "docs" / "configuration.md").read_text()
    for name, setting, _ in settings():
        row = next((line for line in doc.splitlines() if line.startswith(f"| `{name}` |")), None)
        assert row is not None, f"{name} is not in docs/configuration.md"
        assert f"`{setting.flag}`" in row
        assert f"`{env_name(name)}`" in row


def test_serve_refuses_bad_settings_with_one_line(tmp_path: Path) -> None:
    toml = tmp_path / "bad.toml"
    toml.write_text("colour = 'red'\n")
    for args, env, fragment in (
        (["--config", str(toml)], {}, "unknown key 'colour'"),
        (["--workers", "x"], {}, "--workers: workers: 'x': expected an integer"),
        ([], {"SPANWARM_WORKERS": "many"}, "SPANWARM_WORKERS: workers: 'many'"),
    ):
        command = [sys.executable, "-m", "spanwarm", "serve", "--socket", str(tmp_path / "s.sock")]
        result = subprocess.run(
            [*command, *args],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
            env={"PATH": "/usr/bin:/bin", **env},
        )
        assert result.returncode == 2, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert fragment in result.stderr
