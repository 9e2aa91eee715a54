"""Load a model as an SGLang server's schedulers do: one process per tensor-parallel rank
(gloo), each running SGLang's ``DefaultModelLoader.load_model`` after ``load_plugins()``
(so the spanwarm plugin comes in through its installed entry point, as in a server).

    python tests/sglang/sglang_load.py MODEL OUT --tp N [--serial] [--single-thread]
        [--then-no-mmap] [--then-dummy]

Writes ``OUT/proc-<R>.json`` (the rank's pid) and ``OUT/weights-<R>.pt`` (its parameters).
``--serial``: rank R waits for rank R-1's load to end, then drops the checkpoint's pages
(``POSIX_FADV_DONTNEED``) before its own, so that each rank's reads are all its own.
``--single-thread``: ``enable_multithread_load: false`` (SGLang's other iterator).
``--then-no-mmap``, ``--then-dummy``: then load again (TP1), with
``--weight-loader-disable-mmap`` (to ``weights-0-no-mmap.pt``), and with the dummy format.
Needs the ``vllm._custom_ops`` stub on PYTHONPATH (tests/sglang/stubs).
"""

from __future__ import annotations

import argparse
import glob
import json
import logging
import multiprocessing
import os
import socket
import time
from pathlib import Path
from typing import Any


def _init_parallel(rank: int, world: int, port: int) -> None:
    """SGLang's parallel state on gloo, as ``sglang.test.layer_ut_utils`` brings it up
    (its module imports SGLang's benchmark dependencies, so the steps are here)."""
    from sglang.srt.distributed import parallel_state
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    parallel_state.init_distributed_environment(
        world_size=world,
        rank=rank,
        local_rank=rank,
        backend="gloo",
        distributed_init_method=f"tcp://127.0.0.1:{port}",
    )
    if world > 1:  # groups of more than one rank make a pynccl communicator (CUDA only)
        original = parallel_state.init_model_parallel_group

        def init_model_parallel_group(*args: Any, **kwargs: Any) -> Any:
            kwargs.update(
                use_pynccl=False,
                use_custom_allreduce=False,
                use_mscclpp=False,
                use_torch_symm_mem_allreduce=False,
            )
            return original(*args, **kwargs)

        parallel_state.init_model_parallel_group = init_model_parallel_group
    reset_context()
    publish(
        ServerArgs(model_path="dummy", tp_size=world, ep_size=1, pp_size=1),
        role="test",
        ranks=SpawnRanks(world_rank=rank),
    )
    get_parallel().override_permanently(world_group=parallel_state._WORLD)
    parallel_state.initialize_model_parallel(backend="gloo")


def _evict(model: str) -> None:
    for path in glob.glob(os.path.join(model, "*.safetensors")):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    logging.basicConfig(
        level=logging.INFO, format=f"[rank {rank} pid={os.getpid()}] %(name)s: %(message)s"
    )
    import torch
    from sglang.srt.plugins import load_plugins

    load_plugins()
    _init_parallel(rank, world, port)
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import DefaultModelLoader

    out = Path(args.out)
    if args.serial:
        deadline = time.monotonic() + 300
        while rank and not (out / f"done-{rank - 1}").exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {rank - 1} never finished loading")
            time.sleep(0.05)
        _evict(args.model)
    extra = {"enable_multithread_load": False} if args.single_thread else {}
    loader = DefaultModelLoader(LoadConfig(model_loader_extra_config=extra))
    began = time.monotonic()
    model = loader.load_model(
        model_config=ModelConfig(args.model, dtype="float32"), device_config=DeviceConfig("cpu")
    )
    took = time.monotonic() - began
    (out / f"done-{rank}").touch()
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    torch.save(params, out / f"weights-{rank}.pt")
    record = {"rank": rank, "pid": os.getpid(), "load_s": took}
    (out / f"proc-{rank}.json").write_text(json.dumps(record))
    if args.then_no_mmap:  # a second load, with --weight-loader-disable-mmap
        from sglang.srt.runtime_context import get_model

        with get_model().override(weight_loader_disable_mmap=True):
            again = DefaultModelLoader(LoadConfig()).load_model(
                model_config=ModelConfig(args.model, dtype="float32"),
                device_config=DeviceConfig("cpu"),
            )
        params = {name: p.detach().clone() for name, p in again.named_parameters()}
        torch.save(params, out / f"weights-{rank}-no-mmap.pt")
    if args.then_dummy:  # a third, with --load-format dummy (random weights)
        from sglang.srt.model_loader.loader import get_model_loader

        get_model_loader(LoadConfig(load_format="dummy")).load_model(
            model_config=ModelConfig(args.model, dtype="float32"),
            device_config=DeviceConfig("cpu"),
        )
    torch.distributed.barrier()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--serial", action="store_true")
    parser.add_argument("--single-thread", action="store_true")
    parser.add_argument("--then-no-mmap", action="store_true")
    parser.add_argument("--then-dummy", action="store_true")
    args = parser.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if args.tp == 1:
        worker(0, 1, port, args)
        return
    context = multiprocessing.get_context("spawn")
    ranks = [
        context.Process(target=worker, args=(rank, args.tp, port, args)) for rank in range(args.tp)
    ]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join()
    if any(process.exitcode for process in ranks):
        raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in ranks]}")


if __name__ == "__main__":
    main()
