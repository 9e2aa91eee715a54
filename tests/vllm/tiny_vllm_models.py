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
