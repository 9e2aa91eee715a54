"""A test-only vLLM plugin: the ranks of a server load their weights one after another,
each from a cold page cache, so that what each rank reads is all its own.

The ranks of a TP2 server load at once and share the node's page cache: a page both read
is read from storage by whichever comes first. Here rank R waits for rank R-1's load to
end, then drops the checkpoint's pages (``POSIX_FADV_DONTNEED``) before its own. On when
``SPANWARM_TEST_SERIAL_DIR`` names a directory (the test puts this folder on PYTHONPATH,
where its dist-info registers the entry point). ``SPANWARM_TEST_NO_POSTPROCESS=1`` skips
the quantization methods' ``process_weights_after_loading``, which comes after every
read: the CPU build lacks FP8's kernels for it, and a rank failing there would stop the
next one mid-load.
"""

from __future__ import annotations

import functools
import glob
import os
import time
from typing import Any


def register() -> None:
    directory = os.environ.get("SPANWARM_TEST_SERIAL_DIR")
    if not directory:
        return
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    original = DefaultModelLoader.load_weights

    @functools.wraps(original)
    def load_weights(self: Any, model: Any, model_config: Any) -> Any:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        deadline = time.monotonic() + 600
        while rank and not os.path.exists(os.path.join(directory, f"done-{rank - 1}")):
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {rank - 1} never finished loading")
            time.sleep(0.05)
        for path in glob.glob(os.path.join(model_config.model, "*.safetensors")):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        try:
            return original(self, model, model_config)
        finally:
            open(os.path.join(directory, f"done-{rank}"), "w").close()

    DefaultModelLoader.load_weights = load_weights
    if os.environ.get("SPANWARM_TEST_NO_POSTPROCESS") == "1":
        from vllm.model_executor.model_loader import base_loader

        base_loader.process_weights_after_loading = lambda *args, **kwargs: None
