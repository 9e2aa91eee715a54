"""Tiny random models in tmp: a dense Llama and a Qwen2-MoE, sharded in several files."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def write_dense(directory: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,  # fewer KV heads than... TP4: k/v replicated
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    model: Any = LlamaForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(directory, max_shard_size="2MB")
    return directory


def write_moe(directory: Path) -> Path:
    import torch
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen2MoeConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=128,
        num_experts=8,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    model: Any = Qwen2MoeForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(directory, max_shard_size="1MB")
    return directory


def write_fp8(directory: Path, dense: Path) -> Path:
    """``dense`` with its layers' linear weights in FP8 (E4M3) and a per-tensor F32
    ``weight_scale`` each, as vLLM's ``fp8`` quantization serializes them."""
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    directory.mkdir(parents=True)
    for name in ("config.json", "generation_config.json"):
        if (dense / name).exists():
            shutil.copy(dense / name, directory / name)
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    weight_map: dict[str, str] = {}
    for number, shard in enumerate(sorted(dense.glob("*.safetensors"))):
        tensors: dict[str, torch.Tensor] = {}
        for name, tensor in load_file(shard).items():
            if ".layers." in name and name.endswith("_proj.weight"):
                scale = tensor.float().abs().amax().clamp(min=1e-6) / 448.0
                tensors[name] = (tensor.float() / scale).to(torch.float8_e4m3fn)
                tensors[name.removesuffix("weight") + "weight_scale"] = scale.reshape(())
            else:
                tensors[name] = tensor
        file = f"model-{number:05d}.safetensors"
        save_file(tensors, directory / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
    index = {"metadata": {}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return directory
