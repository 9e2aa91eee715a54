"""Daemon logging: human lines by default, one JSON object per line for collectors."""

from __future__ import annotations

import json
import logging
import time

__all__ = ["configure_logging"]


class JsonFormatter(logging.Formatter):
    """``{"ts", "level", "logger", "msg", ...extra fields}`` per record, for journald/Loki/ELK."""

    def format(self, record: logging.LogRecord) -> str:
        document = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        document.update(getattr(record, "fields", {}))
        if record.exc_info:
            document["exc"] = self.formatException(record.exc_info)
        return json.dumps(document, default=str)


_CONTROL = {c: f"\\x{c:02x}" for c in (*range(32), 127)}
_CONTROL[ord("\t")] = "\\t"


class TextFormatter(logging.Formatter):
    """One line per record: control characters in the message (a caller's path or job
    may hold a newline) are escaped, so a client cannot forge log lines. A traceback,
    which the daemon itself writes, stays on its own lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        return super().formatMessage(record).translate(_CONTROL)


def configure_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
