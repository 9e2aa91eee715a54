"""The daemon's settings: one frozen dataclass, the single source of every knob.

Each field carries its flag, its kind and its meaning. Values come from, highest first:
command-line flags, ``SPANWARM_<NAME>`` environment variables, a TOML file (``--config``,
``$SPANWARM_CONFIG``, else /etc/spanwarm/spanwarm.toml when it exists), the defaults
here. An unknown key or a bad value stops the daemon at start with one line naming it.
docs/configuration.md lists every setting (a test keeps it complete).
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from spanwarm.endpoint import access_socket_path, default_socket_path
from spanwarm.planning.costmodel import DEFAULT_SEEK_COST
from spanwarm.units import parse_size

__all__ = [
    "DEFAULT_CONFIG_FILE",
    "ConfigError",
    "DaemonConfig",
    "Setting",
    "load_config",
    "settings",
]

DEFAULT_CONFIG_FILE = "/etc/spanwarm/spanwarm.toml"


class ConfigError(ValueError):
    """A setting that cannot be used; the message names where it came from."""


@dataclass(frozen=True)
class Setting:
    flag: str
    kind: str  # str, int, float, size, paths, bool, or "choice"
    help: str
    choices: tuple[str, ...] = ()


def _setting(
    default: Any, *, flag: str, kind: str, help: str, choices: tuple[str, ...] = ()
) -> Any:
    meta = {"setting": Setting(flag, kind, help, choices)}
    if callable(default):
        return field(default_factory=default, metadata=meta)
    return field(default=default, metadata=meta)


def default_state_dir() -> str:
    """systemd's StateDirectory for root; the XDG state directory for anyone else."""
    if os.geteuid() == 0:
        return "/var/lib/spanwarm"
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(
        os.path.expanduser("~"), ".local", "state"
    )
    return os.path.join(base, "spanwarm")


@dataclass(frozen=True)
class DaemonConfig:
    socket: str = _setting(
        default_socket_path,
        flag="--socket",
        kind="str",
        help="Unix socket to serve on, never abstract (default: $SPANWARM_SOCKET, "
        "/run/spanwarm/spanwarm.sock as root, else per-user)",
    )
    socket_group: str | None = _setting(
        None,
        flag="--socket-group",
        kind="str",
        help="group allowed to connect (socket mode 0660); its members warm only files they "
        "can open themselves (docs/daemon.md, Security model)",
    )
    listen: str | None = _setting(
        None,
        flag="--listen",
        kind="str",
        help="also serve the gRPC health service, and nothing else, on this loopback TCP "
        "address (probes), e.g. 127.0.0.1:7070",
    )
    allow: tuple[str, ...] = _setting(
        (),
        flag="--allow",
        kind="paths",
        help="roots whose files may be warmed, checked on the kernel's name for each open "
        "file (empty: any file its caller can read)",
    )
    workers: int = _setting(
        8, flag="--workers", kind="int", help="warm operations in flight at once (threads)"
    )
    chunk_bytes: int = _setting(
        8 * 2**20,
        flag="--chunk-size",
        kind="size",
        help="largest single warm operation: the device read-ahead window",
    )
    method: str | None = _setting(
        None,
        flag="--method",
        kind="choice",
        help="populate, read or hint (default: populate where the kernel has it)",
        choices=("populate", "read", "hint"),
    )
    seek_cost: int | None = _setting(
        None,
        flag="--seek-cost",
        kind="size",
        help="price of one seek in bytes, on every mount (default: probed per mount once "
        f"the node is idle, {DEFAULT_SEEK_COST // 2**20} MiB until then; measure it by "
        "hand with spanwarm calibrate)",
    )
    max_spans: int = _setting(
        4_000_000, flag="--max-spans", kind="int", help="most spans one Warm request may carry"
    )
    max_files: int = _setting(
        100_000, flag="--max-files", kind="int", help="most files one Warm request may name"
    )
    max_cells: int = _setting(
        131_072,
        flag="--max-cells",
        kind="int",
        help="most distinct chunk-size cells one Warm request may touch (what the daemon keeps "
        "per request; 1 TiB at 8 MiB cells)",
    )
    max_span_cells: int = _setting(
        2_000_000,
        flag="--max-span-cells",
        kind="int",
        help="most (span, cell) pairs one Warm request may make: each span counts the cells "
        "between its first and last byte",
    )
    max_rows: int = _setting(
        8_000_000,
        flag="--max-rows",
        kind="int",
        help="most rows the strided spans of one Warm request may have in total",
    )
    user_max_requests: int = _setting(
        256,
        flag="--user-max-requests",
        kind="int",
        help="most live Warm requests (and unused grants) one uid may have; root and the "
        "daemon's own user are not limited",
    )
    user_max_bytes: int | None = _setting(
        None,
        flag="--user-max-bytes",
        kind="size",
        help="most bytes the live requests of one uid may name (default: no limit)",
    )
    user_max_rows: int = _setting(
        32_000_000,
        flag="--user-max-rows",
        kind="int",
        help="most rows the strided spans of one uid's live requests may have in total "
        "(planning expands every live request's rows of a file together: a few hundred MB "
        "and seconds per 8M); root and the daemon's own user are not limited",
    )
    user_max_files: int = _setting(
        32_768,
        flag="--user-max-files",
        kind="int",
        help="most files one uid's live grants and requests may hold (each grant counts "
        "its files; the daemon keeps one descriptor per distinct file)",
    )
    user_max_in_flight: int | None = _setting(
        None,
        flag="--user-max-in-flight",
        kind="int",
        help="most warm operations one uid's requests may have in flight (default: --workers)",
    )
    stuck_seconds: float = _setting(
        30.0,
        flag="--stuck-seconds",
        kind="float",
        help="a warm operation running longer than this is stuck in hung storage: it stops "
        "counting against --workers, and its user gets no more operations once it has as "
        "many stuck as it may have in flight",
    )
    grant_seconds: float = _setting(
        30.0,
        flag="--grant-seconds",
        kind="float",
        help="how long a token from the access channel stays valid unused",
    )
    drain_seconds: float = _setting(
        10.0,
        flag="--drain-seconds",
        kind="float",
        help="on SIGTERM, how long open streams may take to finish",
    )
    throttle_bytes_per_s: int | None = _setting(
        None,
        flag="--throttle",
        kind="size",
        help="cap on the warm rate in bytes per second (for tests and demos)",
    )
    memory_budget: str | None = _setting(
        None,
        flag="--memory-budget",
        kind="str",
        help="page cache the daemon may keep warmed ahead of consumption: bytes (8GiB) or a "
        "percentage of what the node or its cgroup can give (default: 50%)",
    )
    hold_seconds: float = _setting(
        60.0,
        flag="--hold-seconds",
        kind="float",
        help="under a budget, how long warmed bytes a rank has not reported read count against it",
    )
    hold: bool = _setting(
        False,
        flag="--hold",
        kind="bool",
        help="keep warmed spans mapped until their tensors are read (bounded by the budget), "
        "so reclaim cannot take them in between",
    )
    state_dir: str = _setting(
        default_state_dir,
        flag="--state-dir",
        kind="str",
        help="where the daemon keeps what it learned of each mount across restarts (default: "
        "/var/lib/spanwarm as root, else $XDG_STATE_HOME/spanwarm; empty: keep nothing)",
    )
    evict_after_read: bool = _setting(
        False,
        flag="--evict-after-read",
        kind="bool",
        help="drop what the daemon read into a cell from the page cache once every rank that "
        "needs it has reported it read (memory back after a load; a later load reads it "
        "again; bytes it found resident stay)",
    )
    cgroup_root: str = _setting(
        "/sys/fs/cgroup",
        flag="--cgroup-root",
        kind="str",
        help="where the cgroup filesystem is mounted (for the default budget)",
    )
    metrics: str | None = _setting(
        None,
        flag="--metrics",
        kind="str",
        help="serve Prometheus metrics on this HOST:PORT, e.g. 127.0.0.1:9464",
    )
    log_level: str = _setting(
        "info",
        flag="--log-level",
        kind="choice",
        help="log level",
        choices=("debug", "info", "warning", "error"),
    )
    log_format: str = _setting(
        "text",
        flag="--log-format",
        kind="choice",
        help="text, or json (one object per line) for journald and log collectors",
        choices=("text", "json"),
    )

    def __post_init__(self) -> None:
        if not self.socket or self.socket.startswith(("@", "unix-abstract:")):
            raise ConfigError(
                f"socket: {self.socket!r} must be a filesystem path (no abstract sockets)"
            )
        if self.workers < 1:
            raise ConfigError(f"workers: must be >= 1, got {self.workers}")
        page = os.sysconf("SC_PAGE_SIZE")
        if self.chunk_bytes < page or self.chunk_bytes % page:
            raise ConfigError(
                f"chunk_bytes: must be a positive multiple of {page}, got {self.chunk_bytes}"
            )
        if self.seek_cost is not None and self.seek_cost < 0:
            raise ConfigError(f"seek_cost: must be >= 0, got {self.seek_cost}")
        for name in ("max_spans", "max_files", "max_cells", "max_span_cells", "max_rows"):
            value = getattr(self, name)
            if not 1 <= value <= 2**40:  # the bound keeps admission's sums exact in int64
                raise ConfigError(f"{name}: must be between 1 and 2**40, got {value}")
        for name in (
            "user_max_requests",
            "user_max_files",
            "user_max_bytes",
            "user_max_rows",
            "user_max_in_flight",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:  # None: no cap
                raise ConfigError(f"{name}: must be >= 1, got {value}")
        for name in ("stuck_seconds", "grant_seconds"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}: must be > 0, got {getattr(self, name)}")
        if len(os.fsencode(access_socket_path(self.socket))) > 107:
            raise ConfigError(
                f"socket: {self.socket!r} is too long for a Unix socket with its "
                "'.access' channel beside it (107 bytes in all)"
            )
        if self.drain_seconds < 0:
            raise ConfigError(f"drain_seconds: must be >= 0, got {self.drain_seconds}")
        if self.throttle_bytes_per_s is not None and self.throttle_bytes_per_s <= 0:
            raise ConfigError("throttle_bytes_per_s: must be > 0")
        if self.memory_budget is not None:
            from spanwarm.daemon.budget import parse_budget

            try:
                parse_budget(self.memory_budget, 1)
            except ValueError as exc:
                raise ConfigError(f"memory_budget: {exc}") from None
        if self.hold_seconds <= 0:
            raise ConfigError(f"hold_seconds: must be > 0, got {self.hold_seconds}")
        for name in ("listen", "metrics"):
            address = getattr(self, name)
            if address is not None and ":" not in address:
                raise ConfigError(f"{name}: {address!r} is not HOST:PORT")
        if self.listen is not None:
            host = self.listen.rsplit(":", 1)[0].strip("[]")
            if host not in ("127.0.0.1", "::1", "localhost"):
                raise ConfigError(f"listen: {self.listen!r} must be a loopback address")


def settings() -> list[tuple[str, Setting, Any]]:
    """(field name, setting, default) for every knob, in declaration order."""
    out = []
    for f in fields(DaemonConfig):
        default = f.default_factory() if callable(f.default_factory) else f.default
        out.append((f.name, f.metadata["setting"], default))
    return out


def env_name(name: str) -> str:
    return f"SPANWARM_{name.upper()}"


def _parse(name: str, setting: Setting, raw: Any, source: str) -> Any:
    """A raw value (flag or env string, or a TOML value) as the field's type."""
    where = f"{source}: {name}"
    try:
        if setting.kind == "paths":
            items = raw.split(":") if isinstance(raw, str) else raw
            if not isinstance(items, list | tuple) or not all(
                isinstance(i, str) and i for i in items
            ):
                raise ValueError("expected a list of paths")
            return tuple(items)
        if setting.kind == "bool":
            if isinstance(raw, bool):
                return raw
            if str(raw).lower() in ("1", "true", "yes", "on"):
                return True
            if str(raw).lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError("expected true or false")
        if setting.kind == "int":
            if isinstance(raw, bool) or not isinstance(raw, int | str):
                raise ValueError("expected an integer")
            try:
                return int(raw)
            except ValueError:
                raise ValueError("expected an integer") from None
        if setting.kind == "float":
            if isinstance(raw, bool) or not isinstance(raw, int | float | str):
                raise ValueError("expected a number")
            try:
                return float(raw)
            except ValueError:
                raise ValueError("expected a number") from None
        if setting.kind == "size":
            if isinstance(raw, bool):
                raise ValueError("expected a size")
            return raw if isinstance(raw, int) else parse_size(str(raw))
        if not isinstance(raw, str):
            raise ValueError("expected a string")
        if setting.choices and raw not in setting.choices:
            raise ValueError(f"expected one of {', '.join(setting.choices)}")
        return raw
    except ValueError as exc:
        raise ConfigError(f"{where}: {raw!r}: {exc}") from None


def load_config(
    flags: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    path: str | None = None,
) -> DaemonConfig:
    """Merge flags > ``SPANWARM_*`` environment > TOML file > defaults into one config.

    ``flags`` holds raw values by field name (None: not given). ``path``: the TOML file;
    None means ``$SPANWARM_CONFIG``, else the default file when it exists.
    """
    flags = flags or {}
    env = os.environ if env is None else env
    known = {name: setting for name, setting, _ in settings()}
    values: dict[str, Any] = {}

    config_path = path or env.get("SPANWARM_CONFIG")
    if config_path is None and os.path.exists(DEFAULT_CONFIG_FILE):
        config_path = DEFAULT_CONFIG_FILE
    if config_path is not None:
        try:
            with open(config_path, "rb") as f:
                document = tomllib.load(f)
        except OSError as exc:
            raise ConfigError(f"{config_path}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{config_path}: not TOML: {exc}") from None
        for key, raw in document.items():
            if key not in known:
                raise ConfigError(f"{config_path}: unknown key {key!r}")
            values[key] = _parse(key, known[key], raw, config_path)
    for name, setting in known.items():
        if (raw := env.get(env_name(name))) is not None:
            values[name] = _parse(name, setting, raw, env_name(name))
    for name, raw in flags.items():
        if raw is not None:
            values[name] = _parse(name, known[name], raw, known[name].flag)
    return DaemonConfig(**values)
