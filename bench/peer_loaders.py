"""The loaders users pick instead of spanwarm, as one rank of bench/e2e_rank.py uses them.

Each is used the way its own documentation recommends for loading a safetensors checkpoint
into CPU memory, with its most favourable setting that still yields the tensors the rank
slices its own boxes from (the pyproject extra ``bench-peers`` pins the versions):

- ``cattensors`` (0.2.0): ``cattensors.patch()`` before the load, then the plain
  safetensors load (``safe_open``, ``get_slice``), as the rank's ``none`` arm. The patched
  ``safe_open`` first reads the whole file into the page cache (``CATTENSORS_WARM_THREADS``
  threads, 8 by default, 4 MiB reads); its ``flock`` coordination between a node's
  processes wraps only ``load_file``, which would materialise every tensor of a shard in
  each rank, so ranks that load slices go through ``safe_open``, as transformers does.
- ``runai`` (runai-model-streamer 0.17): ``SafetensorsStreamer.stream_files`` over the
  files that hold the rank's tensors with ``tensor_names`` (its filter: only those tensors
  are read), ``device="cpu"``, ``owned=False`` (tensors are views into its ring, consumed
  before the next: the rank copies its boxes out, so nothing else is allocated). Its
  concurrency and chunk sizes are its defaults; ``RUNAI_STREAMER_MEMORY_LIMIT`` bounds its
  ring where the bench sets it (under ``--memory-limit``). Distributed streaming needs a
  real process group (the ranks here have a fake one), so each rank streams its own.
- ``fastsafetensors`` (0.5): ``ParallelLoader`` with ``nogds=True`` on ``"cpu"``, a
  per-rank ``tensor_filter`` (``all_local=True``, as the filter requires), ``queue_size=1``
  (the next batch is read while this one is copied), ``accumulate_resident=False`` and
  ``borrowed_tensors=True`` (the rank copies its boxes out before the next tensor);
  ``device_memory_budget`` from ``SPANWARM_BENCH_PEER_MEMORY`` where the bench sets it.
- ``instanttensor`` (0.2): ``safe_open(files, device=..., tensor_filter=names,
  tensor_name_match_mode="exact", copy=False)`` over all files at once (its docs: one call
  plans reads across files), iterating ``tensors()``. It loads to CUDA devices only: on a
  CPU rank its ``safe_open`` refuses, and the bench reports that.

``python bench/peer_loaders.py ARM`` checks that ARM imports and runs here: it writes a
tiny checkpoint to a temporary directory, loads it through ARM, and prints ``ok`` or
exits non-zero with the reason on its last line of stderr.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

PEERS = ("cattensors", "runai", "fastsafetensors", "instanttensor")
# The arms whose loader hands the rank whole tensors in its own order (the rank copies its
# boxes out of each); cattensors hands the rank safetensors' own safe_open instead.
STREAMED = ("runai", "fastsafetensors", "instanttensor")
DISTRIBUTIONS = {
    "cattensors": "cattensors",
    "runai": "runai-model-streamer",
    "fastsafetensors": "fastsafetensors",
    "instanttensor": "instanttensor",
}
# Bytes a peer's buffers may take per rank (set by the bench under --memory-limit).
MEMORY_ENV = "SPANWARM_BENCH_PEER_MEMORY"


def peer_memory() -> int | None:
    text = os.environ.get(MEMORY_ENV)
    return int(text) if text else None


def safe_open_of(arm: str) -> Callable[..., Any]:
    """The ``safe_open`` a rank of ``arm`` opens files with: cattensors' patched one, or
    safetensors' own."""
    if arm == "cattensors":
        cattensors: Any = importlib.import_module("cattensors")
        cattensors.patch()  # wraps safetensors.safe_open: look it up after this
    safetensors: Any = importlib.import_module("safetensors")
    return safetensors.safe_open  # type: ignore[no-any-return]


def stream(arm: str, paths: list[str], names: list[str]) -> Iterator[tuple[str, Any]]:
    """``(name, tensor)`` for each of ``names`` (held in ``paths``), in the loader's order.
    A tensor may be a view into the loader's buffers: use it before taking the next."""
    loaders = {
        "runai": stream_runai,
        "fastsafetensors": stream_fastsafetensors,
        "instanttensor": stream_instanttensor,
    }
    return loaders[arm](paths, names)


def stream_runai(paths: list[str], names: list[str]) -> Iterator[tuple[str, Any]]:
    streamer_module: Any = importlib.import_module("runai_model_streamer")
    with streamer_module.SafetensorsStreamer() as streamer:
        streamer.stream_files(paths, device="cpu", tensor_names=names, owned=False)
        yield from streamer.get_tensors()


def stream_fastsafetensors(paths: list[str], names: list[str]) -> Iterator[tuple[str, Any]]:
    fastsafetensors: Any = importlib.import_module("fastsafetensors")
    wanted = frozenset(names)
    loader = fastsafetensors.ParallelLoader(
        None,
        paths,
        queue_size=1,
        use_tqdm_on_load=False,
        device="cpu",
        nogds=True,
        tensor_filter=wanted.__contains__,
        all_local=True,
        accumulate_resident=False,
        borrowed_tensors=True,
        device_memory_budget=peer_memory(),
    )
    weights = loader.iterate_weights()
    try:
        yield from weights
    finally:
        weights.close()  # its buffers first, then the loader (its docs' order)
        loader.close()


def stream_instanttensor(paths: list[str], names: list[str]) -> Iterator[tuple[str, Any]]:
    instanttensor: Any = importlib.import_module("instanttensor")
    with instanttensor.safe_open(
        list(paths),
        framework="pt",
        device="cpu",  # the rank's tensors are CPU tensors; 0.2 accepts CUDA only
        tensor_filter=list(names),
        tensor_name_match_mode="exact",
        copy=False,
    ) as f:
        yield from f.tensors()


def installed(arm: str) -> str | None:
    """The reason ``arm``'s package is not installed here, or None."""
    try:
        importlib.metadata.version(DISTRIBUTIONS[arm])
    except importlib.metadata.PackageNotFoundError:
        return (
            f"{DISTRIBUTIONS[arm]} is not installed "
            "(pip install -c constraints.txt -e '.[bench-peers]')"
        )
    return None


def version(arm: str) -> str:
    return f"{DISTRIBUTIONS[arm]} {importlib.metadata.version(DISTRIBUTIONS[arm])}"


def probe(arm: str) -> None:
    """Load a tiny checkpoint through ``arm``, checking every value (raises where it
    cannot run here)."""
    torch: Any = importlib.import_module("torch")
    save_file = importlib.import_module("safetensors.torch").save_file
    expected = {
        "a.weight": torch.arange(64 * 32, dtype=torch.bfloat16).reshape(64, 32),
        "b.weight": torch.ones(16, dtype=torch.bfloat16),
    }
    with tempfile.TemporaryDirectory(prefix="sw-peer-") as directory:
        path = str(Path(directory) / "model.safetensors")
        save_file(expected, path)
        if arm in STREAMED:
            loaded = {name: t.clone() for name, t in stream(arm, [path], ["a.weight"])}
        else:
            with safe_open_of(arm)(path, framework="pt") as f:
                loaded = {"a.weight": f.get_slice("a.weight")[0:64]}
    if set(loaded) != {"a.weight"} or not torch.equal(loaded["a.weight"], expected["a.weight"]):
        raise RuntimeError(f"{arm}: loaded {sorted(loaded)} with other values than written")


def main() -> None:
    parser = argparse.ArgumentParser(description="check that a peer loader runs here")
    parser.add_argument("arm", choices=PEERS)
    arm = parser.parse_args().arm
    reason = installed(arm)
    if reason is not None:
        sys.exit(reason)
    probe(arm)
    print(f"ok: {version(arm)}")


if __name__ == "__main__":
    main()
