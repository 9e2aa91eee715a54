"""A tiny random Llama in tmp (HF layout: 2 safetensors shards and their index), and
what each tensor-parallel rank of SGLang's Llama must load from it."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, VOCAB = 256, 512, 2, 8, 2, 512


def write_llama(directory: Path) -> Path:
    directory.mkdir(parents=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "vocab_size": VOCAB,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    generator = torch.Generator().manual_seed(0)

    def random(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    head = HIDDEN // HEADS
    tensors = {
        "model.embed_tokens.weight": random(VOCAB, HIDDEN),
        "model.norm.weight": random(HIDDEN),
        "lm_head.weight": random(VOCAB, HIDDEN),
    }
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": random(HIDDEN),
            p + "post_attention_layernorm.weight": random(HIDDEN),
            p + "self_attn.q_proj.weight": random(HEADS * head, HIDDEN),
            p + "self_attn.k_proj.weight": random(KV_HEADS * head, HIDDEN),
            p + "self_attn.v_proj.weight": random(KV_HEADS * head, HIDDEN),
            p + "self_attn.o_proj.weight": random(HIDDEN, HEADS * head),
            p + "mlp.gate_proj.weight": random(INTERMEDIATE, HIDDEN),
            p + "mlp.up_proj.weight": random(INTERMEDIATE, HIDDEN),
            p + "mlp.down_proj.weight": random(HIDDEN, INTERMEDIATE),
        }
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, directory / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, file))
    index = {"metadata": {}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return directory


def expected_parameters(directory: Path, rank: int, tp: int) -> dict[str, torch.Tensor]:
    """Every parameter of rank ``rank`` of SGLang's TP ``tp`` Llama, from the checkpoint:
    fused qkv / gate_up the concatenation of the rank's shards."""
    ckpt: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        ckpt |= load_file(file)

    def rows(t: torch.Tensor) -> torch.Tensor:
        n = t.shape[0] // tp
        return t[rank * n : (rank + 1) * n]

    def columns(t: torch.Tensor) -> torch.Tensor:
        n = t.shape[1] // tp
        return t[:, rank * n : (rank + 1) * n]

    out = {
        "model.embed_tokens.weight": rows(ckpt["model.embed_tokens.weight"]),
        "model.norm.weight": ckpt["model.norm.weight"],
        "lm_head.weight": rows(ckpt["lm_head.weight"]),
    }
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": ckpt[p + "input_layernorm.weight"],
            p + "post_attention_layernorm.weight": ckpt[p + "post_attention_layernorm.weight"],
            p + "self_attn.qkv_proj.weight": torch.cat(
                [rows(ckpt[p + f"self_attn.{x}_proj.weight"]) for x in "qkv"]
            ),
            p + "self_attn.o_proj.weight": columns(ckpt[p + "self_attn.o_proj.weight"]),
            p + "mlp.gate_up_proj.weight": torch.cat(
                [rows(ckpt[p + f"mlp.{x}_proj.weight"]) for x in ("gate", "up")]
            ),
            p + "mlp.down_proj.weight": columns(ckpt[p + "mlp.down_proj.weight"]),
        }
    return out
