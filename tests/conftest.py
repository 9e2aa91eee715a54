"""Shared fixtures: real files in tmp_path only."""

from __future__ import annotations

import importlib.util
import json
import struct
from pathlib import Path

import pytest

# vLLM's tests need vLLM, which lives in a virtualenv of its own (make test runs them there).
collect_ignore_glob = [
    *([] if importlib.util.find_spec("vllm") else ["vllm/*"]),
    # SGLang's likewise.
    *([] if importlib.util.find_spec("sglang") else ["sglang/*"]),
]


def raw_safetensors(header: object, data: bytes = b"", *, pad: bool = True) -> bytes:
    """Bytes of a safetensors file with ``header`` (a JSON-able object or raw bytes)."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    if pad:
        text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


@pytest.fixture
def write_raw(tmp_path: Path):  # type: ignore[no-untyped-def]
    """Write raw bytes to a file in tmp_path and return its path."""

    def write(name: str, content: bytes) -> Path:
        path = tmp_path / name
        path.write_bytes(content)
        return path

    return write
