"""``spanwarm serve``: the node daemon. Its flags are generated from the config dataclass."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from spanwarm.daemon.config import DEFAULT_CONFIG_FILE, ConfigError, load_config, settings
from spanwarm.errors import SpanwarmError


def add_parser(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        "serve",
        help="run the node daemon",
        description=(
            "Serve Warm and Status over a Unix socket: merge every local rank's spans, warm the "
            "page cache, stream per-tensor readiness. Needs no configuration. Settings come from "
            "flags, then SPANWARM_<NAME> variables, then the TOML file, then defaults "
            "(docs/configuration.md)."
        ),
    )
    parser.add_argument(
        "--config",
        metavar="TOML",
        help=f"settings file (default: $SPANWARM_CONFIG, else {DEFAULT_CONFIG_FILE} if it exists)",
    )
    for name, setting, default in settings():
        shown = f" (default: {default})" if default not in (None, (), "") else ""
        shown = shown.replace("%", "%%")
        setting = dataclasses.replace(setting, help=setting.help.replace("%", "%%"))  # argparse
        if setting.kind == "paths":
            parser.add_argument(
                setting.flag,
                dest=name,
                action="append",
                metavar="DIR",
                help=f"{setting.help} (repeatable)",
            )
        elif setting.kind == "bool":
            parser.add_argument(
                setting.flag, dest=name, action="store_const", const=True, help=setting.help
            )
        else:
            parser.add_argument(
                setting.flag,
                dest=name,
                choices=setting.choices or None,
                help=f"{setting.help}{shown}",
            )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from spanwarm.daemon.logs import configure_logging
    from spanwarm.daemon.server import UnsafeSocketError
    from spanwarm.daemon.server import run as run_daemon

    flags = {name: getattr(args, name) for name, _, _ in settings()}
    try:
        config = load_config(flags, path=args.config)
    except ConfigError as exc:
        print(f"spanwarm serve: error: {exc}", file=sys.stderr)
        return 2
    configure_logging(config.log_level, config.log_format)
    try:
        return run_daemon(config)
    except UnsafeSocketError as exc:
        print(f"spanwarm serve: {exc}", file=sys.stderr)
        return 2
    except (SpanwarmError, OSError) as exc:
        print(f"spanwarm serve: {exc}", file=sys.stderr)
        return 1
