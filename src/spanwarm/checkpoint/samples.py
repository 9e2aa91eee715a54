"""Synthetic safetensors checkpoints for the demo, the tests and the benchmarks.

Files are written the way the reference writer lays them out (header padded with
spaces to a multiple of 8, tensors ordered by alignment then name). Tensors given only
as ``(dtype, shape)`` are left as a hole (``ftruncate``), so a multi-GiB checkpoint costs
no disk and no time; tensors given as bytes are written out.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from math import prod
from pathlib import Path

from spanwarm.checkpoint.resolve import INDEX_FILE
from spanwarm.checkpoint.safetensors_header import DTYPE_BITS

__all__ = [
    "SparseTensor",
    "seed_repro_checkpoints",
    "write_safetensors",
    "write_sharded_checkpoint",
]


@dataclass(frozen=True)
class SparseTensor:
    """A tensor known only by dtype and shape; its bytes read as zeros."""

    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * DTYPE_BITS[self.dtype] // 8


Tensor = SparseTensor | tuple[str, tuple[int, ...], bytes]


def _layout(tensor: Tensor) -> tuple[str, tuple[int, ...], int]:
    if isinstance(tensor, SparseTensor):
        return tensor.dtype, tensor.shape, tensor.nbytes
    dtype, shape, data = tensor
    return dtype, shape, len(data)


def write_safetensors(
    path: str | os.PathLike[str],
    tensors: Mapping[str, Tensor],
    *,
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Write a valid safetensors file; returns its path."""
    order = sorted(tensors, key=lambda n: (-DTYPE_BITS[_layout(tensors[n])[0]], n))
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name in order:
        dtype, shape, nbytes = _layout(tensors[name])
        header[name] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path = Path(path)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for name in order:
            tensor = tensors[name]
            if isinstance(tensor, SparseTensor):
                f.seek(tensor.nbytes, os.SEEK_CUR)
            else:
                f.write(tensor[2])
        f.truncate(8 + len(text) + offset)
    return path


def write_sharded_checkpoint(
    directory: str | os.PathLike[str],
    tensors: Mapping[str, Tensor],
    *,
    shard_bytes: int,
) -> list[Path]:
    """Split ``tensors`` (in the given order) into shards of about ``shard_bytes`` plus an index."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = _layout(tensor)[2]
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    paths = []
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        paths.append(write_safetensors(directory / name, shard))
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(_layout(t)[2] for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2))
    return paths


def seed_repro_checkpoints(
    directory: str | os.PathLike[str], *, experts: int = 32, hidden: int = 2048, layers: int = 2
) -> tuple[Path, Path]:
    """The seed PR's repro layouts: packed experts, and one tensor per expert (bf16)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    packed = {
        f"model.layers.{i}.mlp.experts.gate_up_proj": SparseTensor(
            "BF16", (experts, hidden, hidden)
        )
        for i in range(layers)
    }
    per_expert = {
        f"model.layers.{i}.mlp.experts.{e}.gate_up_proj": SparseTensor("BF16", (hidden, hidden))
        for i in range(layers)
        for e in range(experts)
    }
    return (
        write_safetensors(directory / "packed.safetensors", packed),
        write_safetensors(directory / "per_expert.safetensors", per_expert),
    )
