"""Random-weight checkpoints at a benchmark's size, written straight to safetensors: no model
object, no training. What a step costs depends on the shapes, not on what the weights know.

Each matrix has std fan_in ** -0.5 and the embeddings std 1 (as tools/tiny_arch/build.py's
init_random: activations keep their scale, nothing overflows in bfloat16), biases std 0.02, norm
scales near one, drawn from one seeded generator in name order on one thread, float32 or cast to
bfloat16, in shards of at most 1 GiB with Hugging Face's index: the same machine and torch give
the same bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from common.model_cache import progress
from engine.config import DTYPES
from tools.tiny_model.build import fixed_threads, write_json

SHARD_BYTES = 1 << 30


def random_tensor(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Norm scales near one, embeddings std 1, biases std 0.02, matrices std fan_in ** -0.5."""
    tensor = torch.empty(shape, dtype=torch.float32)
    if name.endswith("norm.weight"):
        return tensor.normal_(1.0, 0.1, generator=generator)
    if name.endswith("embed_tokens.weight"):
        return tensor.normal_(0.0, 1.0, generator=generator)
    if name.endswith(".bias"):
        return tensor.normal_(0.0, 0.02, generator=generator)
    return tensor.normal_(0.0, shape[1] ** -0.5, generator=generator)


def shard_plan(shapes: Mapping[str, tuple[int, ...]], element_bytes: int) -> list[list[str]]:
    """Names in order, cut into shards of at most SHARD_BYTES (a larger tensor alone)."""
    shards: list[list[str]] = [[]]
    filled = 0
    for name, shape in shapes.items():
        num_bytes = element_bytes * torch.Size(shape).numel()
        if shards[-1] and filled + num_bytes > SHARD_BYTES:
            shards.append([])
            filled = 0
        shards[-1].append(name)
        filled += num_bytes
    return shards


def write_random_weights(
    path: Path, shapes: Mapping[str, tuple[int, ...]], dtype: str, seed: int, label: str
) -> int:
    """Every tensor of `shapes` (in name order) drawn and written into `path` in `dtype`, with
    the index when there is more than one shard; the bytes written."""
    torch_dtype = DTYPES[dtype]
    shapes = dict(sorted(shapes.items()))
    shards = shard_plan(shapes, torch.empty((), dtype=torch_dtype).element_size())
    files = shard_names(len(shards))
    generator = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    total_bytes = 0
    with fixed_threads(1):
        for names, file in zip(shards, files, strict=True):
            tensors = {
                name: random_tensor(name, shapes[name], generator).to(torch_dtype) for name in names
            }
            save_file(tensors, str(path / file), metadata={"format": "pt"})
            total_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
            weight_map |= dict.fromkeys(names, file)
            progress(f"{label}: {file} written ({len(names)} tensors)")
    if len(files) > 1:
        index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
        write_json(path / "model.safetensors.index.json", index)
    return total_bytes


def shard_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
