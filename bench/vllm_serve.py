"""Start a vLLM engine on CPU (``vllm.LLM``), generate a few tokens, print them as JSON.

``python bench/vllm_serve.py MODEL --tp N [--pp N] [--ep] [--no-generate]
[--load-strategy S] [--load-format F]``: the last line of
stdout is ``{"tokens": [...], "start_s": ...}``. Run as its own process: vLLM spawns its
workers, and the plugin (``SPANWARM_VLLM``) is switched by the environment.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", action="store_true")
    parser.add_argument("--ep-filter", action="store_true")
    parser.add_argument("--no-generate", action="store_true")
    parser.add_argument("--load-strategy", default=None)
    parser.add_argument("--load-format", default="auto")
    args = parser.parse_args()
    workers = args.tp * args.pp
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if workers > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join("0" for _ in range(workers)))
    from vllm import LLM, SamplingParams

    began = time.monotonic()
    extra = {} if args.load_strategy is None else {"safetensors_load_strategy": args.load_strategy}
    llm = LLM(
        model=args.model,
        tensor_parallel_size=args.tp,
        pipeline_parallel_size=args.pp,
        enable_expert_parallel=args.ep,
        enable_ep_weight_filter=args.ep_filter,
        skip_tokenizer_init=True,
        max_model_len=128,
        enforce_eager=True,
        dtype="bfloat16",
        load_format=args.load_format,
        **extra,
    )
    start_s = time.monotonic() - began
    tokens: list[int] = []
    if not args.no_generate:
        out = llm.generate(
            [{"prompt_token_ids": [1, 2, 3, 4, 5]}],
            SamplingParams(max_tokens=8, temperature=0),
        )
        tokens = list(out[0].outputs[0].token_ids)
    print(json.dumps({"tokens": tokens, "start_s": start_s}), flush=True)


if __name__ == "__main__":
    main()
