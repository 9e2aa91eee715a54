"""spanwarm demo: one node of a multi-node job loads a sharded checkpoint through the daemon.

1. Start a daemon on a private socket (nothing configured).
2. Write a sample sharded checkpoint (a Llama-like dense model, real bytes) and evict it
   from the page cache.
3. Start the node's rank processes of a 4-node x 2-rank job (FSDP x TP on a 2x4 mesh);
   each builds its meta DTensors, requests its spans, and reads each tensor's slice
   through safetensors as soon as the daemon says it is warm.
4. Print the node plan, each rank's time to its first tensor, and the bytes read from
   storage against warming whole files; stop the daemon with SIGTERM.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from spanwarm.checkpoint.samples import write_sharded_checkpoint
from spanwarm.client import Client
from spanwarm.pagecache.residency import evict
from spanwarm.testing.spawn import spawn_daemon
from spanwarm.units import format_bytes

HIDDEN, INTERMEDIATE, LAYERS, VOCAB = 1024, 2816, 8, 32000
NODES, LOCAL_WORLD, MESH = 4, 2, "2x4"  # 8 ranks; this machine plays node 0
HERE = Path(__file__).resolve().parent


def write_checkpoint(directory: Path) -> list[Path]:
    rng = np.random.default_rng(0)

    def tensor(*shape: int) -> tuple[str, tuple[int, ...], bytes]:
        nbytes = int(np.prod(shape)) * 2
        return ("BF16", shape, rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes())

    tensors = {"model.embed_tokens.weight": tensor(VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        tensors[f"{p}.input_layernorm.weight"] = tensor(HIDDEN)
        tensors[f"{p}.self_attn.q_proj.weight"] = tensor(HIDDEN, HIDDEN)
        tensors[f"{p}.self_attn.k_proj.weight"] = tensor(HIDDEN // 4, HIDDEN)
        tensors[f"{p}.self_attn.v_proj.weight"] = tensor(HIDDEN // 4, HIDDEN)
        tensors[f"{p}.self_attn.o_proj.weight"] = tensor(HIDDEN, HIDDEN)
        tensors[f"{p}.post_attention_layernorm.weight"] = tensor(HIDDEN)
        tensors[f"{p}.mlp.gate_proj.weight"] = tensor(INTERMEDIATE, HIDDEN)
        tensors[f"{p}.mlp.up_proj.weight"] = tensor(INTERMEDIATE, HIDDEN)
        tensors[f"{p}.mlp.down_proj.weight"] = tensor(HIDDEN, INTERMEDIATE)
    tensors["model.norm.weight"] = tensor(HIDDEN)
    tensors["lm_head.weight"] = tensor(VOCAB, HIDDEN)
    paths = write_sharded_checkpoint(directory, tensors, shard_bytes=96 * 2**20)
    for path in paths:
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
        evict(path)
    return paths


def main() -> None:
    with (
        tempfile.TemporaryDirectory(prefix="spanwarm-demo-") as tmp,
        contextlib.ExitStack() as stack,
    ):
        socket = os.path.join(tmp, "spanwarm.sock")
        print(f"1. daemon: spanwarm serve --socket {socket}")
        daemon = stack.enter_context(spawn_daemon("--log-level", "warning", socket_path=socket))

        checkpoint = Path(tmp) / "checkpoint"
        paths = write_checkpoint(checkpoint)
        total = sum(p.stat().st_size for p in paths)
        print(f"2. checkpoint: {len(paths)} shards, {format_bytes(total)}, evicted from page cache")

        world = NODES * LOCAL_WORLD
        print(
            f"3. node 0 of {NODES}: ranks 0..{LOCAL_WORLD - 1} of {world}, mesh {MESH} (FSDP x TP)"
        )
        barrier = Path(tmp) / "barrier"
        barrier.mkdir()
        start = time.monotonic()
        ranks = [
            subprocess.Popen(
                [
                    sys.executable,
                    str(HERE / "demo_rank.py"),
                    str(checkpoint),
                    socket,
                    "--rank",
                    str(r),
                    "--world",
                    str(world),
                    "--mesh",
                    MESH,
                    "--local-world",
                    str(LOCAL_WORLD),
                    "--barrier",
                    str(barrier),
                ],
                stdout=subprocess.PIPE,
            )
            for r in range(LOCAL_WORLD)
        ]
        watcher = Client(socket)
        widest: dict[str, Any] = {"files": []}
        while any(p.poll() is None for p in ranks):
            snapshot = watcher.status()
            if snapshot["bytes_planned"] > sum(f["warm_bytes"] for f in widest["files"]):
                widest = snapshot
            time.sleep(0.02)
        outputs = [p.communicate()[0] for p in ranks]
        if any(p.returncode for p in ranks):
            raise SystemExit(f"a rank failed: exit statuses {[p.returncode for p in ranks]}")
        results = [json.loads(out) for out in outputs]
        wall = time.monotonic() - start
        final = watcher.status()
        watcher.close()

        print("\nnode plan (at its widest):")
        for f in widest["files"]:
            needed, reads = format_bytes(f["needed_bytes"]), format_bytes(f["warm_bytes"])
            print(
                f"  {Path(f['path']).name}: {f['decision']:5s} needed {needed} in "
                f"{f['num_runs']} run(s), reads {reads} of {format_bytes(f['size_bytes'])}"
            )
        print("\nranks (each starts with ~2 s of torch import):")
        for r in results:
            print(
                f"  rank {r['rank']}: first tensor after {r['first_s'] * 1000:.0f} ms, "
                f"all {r['tensors']} after {r['total_s']:.2f} s, "
                f"read {format_bytes(r['bytes'])} of its slices"
            )
        read = final["bytes_read_total"]
        print(
            f"\nbytes read from storage by the daemon: {format_bytes(read)} "
            f"(+{format_bytes(final['bytes_verified_total'])} found resident); whole-file warming "
            f"would read {format_bytes(total)} on this node: {total / max(read, 1):.1f}x more"
        )
        print(f"node loaded in {wall:.2f} s")

        print(f"4. daemon stopped with exit status {daemon.stop()}")


if __name__ == "__main__":
    main()
