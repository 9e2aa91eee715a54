"""A stand-in ``vllm._custom_ops`` in every process of SGLang's tests (on PYTHONPATH).

SGLang 0.5.23's ``RotaryEmbedding.__init__`` imports ``vllm._custom_ops.rotary_embedding``
on a host that is neither CUDA, HIP, XPU nor its CPU engine (whose kernels are not on
PyPI); it calls it only in a forward pass on such a host, which these tests never run.
"""

import sys
import types
from typing import Any, NoReturn

if "vllm" not in sys.modules:

    def rotary_embedding(*args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError("vllm._custom_ops stub of spanwarm's SGLang tests")

    _vllm = types.ModuleType("vllm")
    _vllm.__path__ = []
    _ops = types.ModuleType("vllm._custom_ops")
    _ops.rotary_embedding = rotary_embedding  # type: ignore[attr-defined]
    _vllm._custom_ops = _ops  # type: ignore[attr-defined]
    sys.modules["vllm"] = _vllm
    sys.modules["vllm._custom_ops"] = _ops
