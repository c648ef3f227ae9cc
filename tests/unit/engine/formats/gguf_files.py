"""Small GGUF files written with gguf-py's own writer, for the reader's and writer's tests."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter

Q = GGMLQuantizationType
TOKENS = ["<unk>", "<s>", "</s>", "a", "b", "c", "ab", "bc"]


def write_gguf(
    path: Path,
    arch: str,
    metadata: dict[str, Any],
    tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType | None]],
) -> Path:
    """`metadata` keys without the "{arch}." prefix are written with it unless they start with
    "tokenizer." or "general."; a tensor's dtype is its array's unless a raw type is given (its
    array then holds the stored bytes)."""
    writer = GGUFWriter(path, arch)
    for key, value in metadata.items():
        full = key if key.startswith(("tokenizer.", "general.")) else f"{arch}.{key}"
        if isinstance(value, bool):
            writer.add_bool(full, value)
        elif isinstance(value, int):
            writer.add_uint32(full, value)
        elif isinstance(value, float):
            writer.add_float32(full, value)
        elif isinstance(value, str):
            writer.add_string(full, value)
        else:
            writer.add_array(full, value)
    for name, (array, raw_dtype) in tensors.items():
        writer.add_tensor(name, array, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def llama_metadata(**overrides: Any) -> dict[str, Any]:
    """A 2-layer Llama: hidden 64, 4 query heads and 2 KV heads of 16, MLP 96."""
    metadata: dict[str, Any] = {
        "block_count": 2,
        "context_length": 256,
        "embedding_length": 64,
        "feed_forward_length": 96,
        "attention.head_count": 4,
        "attention.head_count_kv": 2,
        "rope.freq_base": 500000.0,
        "rope.dimension_count": 16,
        "attention.layer_norm_rms_epsilon": 1e-5,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": TOKENS,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "general.name": "tiny",
    }
    metadata.update(overrides)
    return metadata


def llama_hf_state(seed: int = 0) -> dict[str, np.ndarray]:
    """Float32 weights for llama_metadata under Hugging Face names, lm_head tied."""
    rng = np.random.default_rng(seed)
    state = {
        "model.embed_tokens.weight": rng.standard_normal((len(TOKENS), 64)),
        "model.norm.weight": 1 + 0.1 * rng.standard_normal(64),
    }
    for i in range(2):
        layer = f"model.layers.{i}"
        for name, shape in {
            "input_layernorm": (64,),
            "post_attention_layernorm": (64,),
            "self_attn.q_proj": (64, 64),
            "self_attn.k_proj": (32, 64),
            "self_attn.v_proj": (32, 64),
            "self_attn.o_proj": (64, 64),
            "mlp.gate_proj": (96, 64),
            "mlp.up_proj": (96, 64),
            "mlp.down_proj": (64, 96),
        }.items():
            state[f"{layer}.{name}.weight"] = rng.standard_normal(shape) / math.sqrt(shape[-1])
    return {name: array.astype(np.float32) for name, array in state.items()}


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to a Llama's q / k rows, written out here
    independently of the reader: per head, the two rotary halves interleaved."""
    half = weight.shape[0] // num_heads // 2
    grouped = weight.reshape(num_heads, 2, half, *weight.shape[1:])
    return grouped.swapaxes(1, 2).reshape(weight.shape)
