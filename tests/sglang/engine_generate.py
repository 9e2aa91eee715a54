"""A full ``sglang.Engine`` on CPU, by hand (not part of the suite: about 50 s a start):
greedy tokens of a tiny model written to tmp, with or without spanwarm.

    PYTHONPATH=.:tests/sglang/stubs .venv-sglang/bin/python tests/sglang/engine_generate.py
    PYTHONPATH=.:tests/sglang/stubs SPANWARM_SGLANG=1 \\
        .venv-sglang/bin/python tests/sglang/engine_generate.py --daemon

Prints one JSON line: the tokens, and (with ``--daemon``: a real daemon on a private
socket, SPANWARM_SOCKET pointing at it) what the scheduler requested. Needs the Engine's
own packages besides the test environment's: ``uvicorn fastapi setproctitle
xgrammar==0.2.7``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--daemon", action="store_true")
    args = parser.parse_args()
    import sglang

    from spanwarm.testing.spawn import spawn_daemon
    from tests.sglang.tiny_sglang_model import write_llama

    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        model = write_llama(Path(tmp) / "llama")
        spans = Path(tmp) / "spans"
        spans.mkdir()
        os.environ["SPANWARM_SGLANG_SPANS_DIR"] = str(spans)
        if args.daemon:
            daemon = stack.enter_context(spawn_daemon())
            os.environ["SPANWARM_SOCKET"] = daemon.socket
        engine: Any = sglang.Engine(
            model_path=str(model),
            device="cpu",
            tp_size=1,
            skip_tokenizer_init=True,
            load_format="safetensors",
            dtype="float32",
            attention_backend="torch_native",
            disable_cuda_graph=True,
            mem_fraction_static=0.1,
            max_total_tokens=2048,
            log_level="info",
        )
        try:
            out = engine.generate(
                input_ids=[1, 5, 7], sampling_params={"max_new_tokens": 8, "temperature": 0}
            )
        finally:
            engine.shutdown()
        requests = {
            path.name: len(json.loads(path.read_text())["spans"]) for path in spans.glob("*.json")
        }
        print(json.dumps({"tokens": out["output_ids"], "requests": requests}), flush=True)


if __name__ == "__main__":
    main()
