"""A cold vLLM server start, TP2 on one node, with and without spanwarm.

    .venv-vllm/bin/python bench/bench_vllm_load.py [--mounts local,cross-region] [--reps 2]

Runs in the vLLM environment with the peer loaders (``make bench-vllm`` installs them into
``.venv-vllm`` and runs this with its defaults). A random dense Llama of
about 0.4 GB in 4 safetensors shards (written once under ``--work``) is served by the
emulated mount (``slowfs``: ``local`` passes reads straight through, ``cross-region``
adds the seed's 50 ms a seek and 0.24 GiB/s a stream), mounted once per mount kind and
evicted from the page cache before every run (checked with mincore). Each run is one
``vllm.LLM(...)`` start on CPU, TP2, then 8 tokens generated. Before the measured runs,
one ``spanwarm`` start (not measured) is the node's first on the mount: the daemon
learns the mount's throughput from it, as on a node whose first server has started.
Arms, interleaved per repetition:

- ``default``: vLLM's default loader (zero-copy views of the mapping, read as its weight
  loaders copy);
- ``prefetch``: ``--safetensors-load-strategy prefetch`` (whole files, split by rank);
- ``runai_streamer``: ``--load-format runai_streamer`` (runai-model-streamer's concurrent
  reads of every tensor the rank loads);
- ``fastsafetensors``: ``--load-format fastsafetensors`` (where it runs: vLLM asks it for
  a ``cuda:<rank>`` device, which a CPU build does not have);
- ``spanwarm``: the default loader with ``SPANWARM_VLLM=1`` and a daemon on the node.

An arm whose server does not start says why in the table (the error it ended with).

Reported per arm (medians): the whole ``LLM(...)`` start; the model's load in the slowest
worker (the model runner's ``load_model``: building the model, the dry run for spanwarm,
reading the weights; timed the same way for every load format by the benchmark's own
vLLM plugin, ``bench/vllm_timing``); the weights' load as vLLM's default loader logs it
("Loading weights took", the slowest rank; other loaders log none); bytes read from
storage (the mount's counter), and the checkpoint's page cache right after the start.
``touched``: the pages the node's ranks read, from the dry run (exact: tests/vllm);
``dry run s``: its time in the slowest rank. Tokens must be equal in every run.
``--json PATH`` writes every run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import span_pages
from spanwarm.pagecache.residency import evict, file_residency
from spanwarm.testing.slowfs import fuse_available, mount
from spanwarm.testing.spawn import spawn_daemon

SERVE = Path(__file__).with_name("vllm_serve.py")
TIMING_PLUGIN = Path(__file__).with_name("vllm_timing")
ARMS = ("default", "prefetch", "runai_streamer", "fastsafetensors", "spanwarm")
LOAD_FORMATS = ("runai_streamer", "fastsafetensors")
_WEIGHTS = re.compile(r"Loading weights took ([0-9.]+) seconds")
_MODEL_LOAD = re.compile(r"spanwarm-bench: rank \d+ loaded its model in ([0-9.]+) s")
_DRY_RUN = re.compile(r"spanwarm: rank \d+ reads .*\(dry run, ([0-9.]+) s\)")
_ERROR = re.compile(r"(?:^|\] )\s*(?:\w+\.)*(\w*(?:Error|Exception)): (.+)$", re.MULTILINE)


def write_model(directory: Path) -> Path:
    """A dense Llama of about 0.4 GB (bf16), in 4 shards; kept between runs."""
    if (directory / "config.json").exists():
        return directory
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    model: Any = LlamaForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(directory, max_shard_size="120MB")
    return directory


def run(arm: str, fs: Any, model: Path, socket: str, work: Path) -> dict[str, Any]:
    """One cold start of ``arm`` on mount ``fs`` of ``model``."""
    spans = Path(tempfile.mkdtemp(prefix="spans-", dir=work))
    env = {
        **os.environ,
        "SPANWARM_VLLM": "0",
        "SPANWARM_BENCH_TIMING": "1",
        "PYTHONPATH": os.pathsep.join([str(SERVE.parents[1]), str(TIMING_PLUGIN)]),
    }
    args = ["--tp", "2"]
    if arm == "prefetch":
        args += ["--load-strategy", "prefetch"]
    elif arm in LOAD_FORMATS:
        args += ["--load-format", arm]
    elif arm == "spanwarm":
        env.update(SPANWARM_VLLM="1", SPANWARM_SOCKET=socket, SPANWARM_VLLM_SPANS_DIR=str(spans))
    files = [fs.path(p.name) for p in sorted(model.glob("*.safetensors"))]
    for path in files:
        evict(path)
    before = fs.stats()["bytes"]
    done = subprocess.run(
        [sys.executable, str(SERVE), str(fs.path("")), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    log = done.stdout + done.stderr
    result = [line for line in done.stdout.splitlines() if line.startswith('{"tokens"')]
    if done.returncode or not result:
        if arm in LOAD_FORMATS:  # a peer that does not run here: the table says why
            return {"arm": arm, "error": did_not_start(log)}
        raise RuntimeError(f"{arm} failed:\n{log[-4000:]}")
    cached = sum(file_residency(path)[0] for path in files)
    out = json.loads(result[-1])
    record = {
        "arm": arm,
        "start_s": out["start_s"],
        "weights_s": max((float(s) for s in _WEIGHTS.findall(log)), default=None),
        "model_load_s": max(float(s) for s in _MODEL_LOAD.findall(log)),
        "read_bytes": fs.stats()["bytes"] - before,
        "cached_bytes": cached,
        "tokens": out["tokens"],
    }
    if arm == "spanwarm":
        record["touched_bytes"] = touched_bytes(spans)
        record["dry_run_s"] = max((float(s) for s in _DRY_RUN.findall(log)), default=None)
    return record


def did_not_start(log: str) -> str:
    """The first error a server's log names besides vLLM's own wrap-ups."""
    for kind, message in _ERROR.findall(log):
        if "initialization failed" not in message and "failed to start" not in message:
            return f"{kind}: {message.strip()}"[:120]
    return "the server did not start"


def touched_bytes(spans_dir: Path) -> int:
    """Bytes of the pages the node's ranks read (the union of their requests, in pages)."""
    return span_pages.touched_bytes(
        [tuple(s[1:]) for s in json.loads(path.read_text())["spans"]]
        for path in spans_dir.glob("rank-*.json")
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mounts", default="local,cross-region")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--work", type=Path, default=Path("/var/tmp/spanwarm-bench/vllm"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if (reason := fuse_available()) is not None:
        sys.exit(f"the emulated mount is not available: {reason}")
    args.work.mkdir(parents=True, exist_ok=True)
    model = write_model(args.work / "model")
    size = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    print(f"model: {size / 2**20:.0f} MiB in {len(list(model.glob('*.safetensors')))} files")
    runs: list[dict[str, Any]] = []
    with spawn_daemon() as daemon:
        for preset in args.mounts.split(","):
            with mount(model, args.work / "mnt", preset) as fs:
                run("spanwarm", fs, model, daemon.socket, args.work)  # the node's first
                for rep in range(args.reps):
                    for arm in args.arms.split(","):
                        record = {"mount": preset, "rep": rep}
                        record.update(run(arm, fs, model, daemon.socket, args.work))
                        runs.append(record)
                        print(json.dumps(record), flush=True)
    tokens = {tuple(r["tokens"]) for r in runs if "tokens" in r}
    print(f"tokens equal in every run: {len(tokens) == 1}")
    print(summary(runs))
    if args.json:
        args.json.write_text(json.dumps({"model_bytes": size, "runs": runs}, indent=1))


def summary(runs: list[dict[str, Any]]) -> str:
    """Per mount and arm, medians; ratios are default/arm paired within a repetition."""
    lines = [
        "| mount | arm | start s | model load s | weights s | read MiB | page cache MiB "
        "| default/arm: start | model load |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for preset in dict.fromkeys(r["mount"] for r in runs):
        of = [r for r in runs if r["mount"] == preset]
        default = {r["rep"]: r for r in of if r["arm"] == "default"}
        for arm in dict.fromkeys(r["arm"] for r in of):
            mine = [r for r in of if r["arm"] == arm and "error" not in r]
            if not mine:
                error = next(r["error"] for r in of if r["arm"] == arm)
                lines.append(f"| {preset} | {arm} | did not run here: {error} | | | | | | |")
                continue
            paired = [(default[r["rep"]], r) for r in mine if r["rep"] in default]
            weights = [r["weights_s"] for r in mine if r.get("weights_s") is not None]
            lines.append(
                f"| {preset} | {arm} | {_median(mine, 'start_s'):.1f} "
                f"| {_median(mine, 'model_load_s'):.2f} "
                f"| {f'{statistics.median(weights):.2f}' if weights else '-'} "
                f"| {_median(mine, 'read_bytes') / 2**20:.0f} "
                f"| {_median(mine, 'cached_bytes') / 2**20:.0f} "
                f"| {_paired(paired, 'start_s'):.2f} | {_paired(paired, 'model_load_s'):.2f} |"
            )
        touched = [r["touched_bytes"] for r in of if "touched_bytes" in r]
        if touched:
            dry = max(r["dry_run_s"] or 0 for r in of if "dry_run_s" in r)
            lines.append(
                f"| {preset} | touched by the ranks (dry run {dry:.2f} s) | | | "
                f"| {touched[0] / 2**20:.0f} | | | |"
            )
    return "\n".join(lines)


def _paired(pairs: list[tuple[dict[str, Any], dict[str, Any]]], key: str) -> float:
    return float(statistics.median(d[key] / r[key] for d, r in pairs))


def _median(runs: list[dict[str, Any]], key: str) -> float:
    return float(statistics.median(r[key] for r in runs))


if __name__ == "__main__":
    main()
