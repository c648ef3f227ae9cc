"""A llama.cpp GGUF file read as it is stored: the model's config as a Hugging Face config dict
and every tensor under its Hugging Face name, quantized matrices as QuantizedWeight (no float
checkpoint in between).

    load_gguf(path) -> GGUFCheckpoint(config, tensors)
        config   {"model_type": "llama", "hidden_size": 576, ...}: what config.json would say
        tensors  "model.layers.0.self_attn.q_proj.weight" -> QuantizedWeight (Q8_0, Q4_0, Q4_1,
                 Q5_0, Q4_K, Q6_K; see gguf_blocks.py) or torch.Tensor (F32, F16, BF16 as stored)

Architectures: llama (Llama 1-3, SmolLM, Mistral as llama.cpp converts it), qwen2, qwen3.
llama.cpp's converter permutes the rows of a Llama's q and k projections (per head, the two
rotary halves interleaved, for its GPT-J style rotation); the rows are put back as transformers
does, on the stored blocks, so a quantized matrix is permuted without being dequantized. Llama
3.1's `rope_freqs` tensor (per-frequency divisors llama.cpp computed from its llama3 scaling)
becomes a longrope config whose short and long factors are those divisors, which is the same
rotation.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader

from engine.formats.gguf_blocks import LAYOUTS, unpack_blocks
from engine.quant.weight import QuantizedWeight

Q = GGMLQuantizationType
Tensor = torch.Tensor | QuantizedWeight

# GGUF architecture -> (Hugging Face model_type, architecture class, q/k rows permuted)
ARCHITECTURES: dict[str, tuple[str, str, bool]] = {
    "llama": ("llama", "LlamaForCausalLM", True),
    "qwen2": ("qwen2", "Qwen2ForCausalLM", False),
    "qwen3": ("qwen3", "Qwen3ForCausalLM", False),
}
# "{arch}.{key}" -> config key
_CONFIG_KEYS = {
    "vocab_size": "vocab_size",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "block_count": "num_hidden_layers",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "context_length": "max_position_embeddings",
}
_TOKEN_KEYS = {
    "tokenizer.ggml.bos_token_id": "bos_token_id",
    "tokenizer.ggml.padding_token_id": "pad_token_id",
}
# llama.cpp stops on every end-of-generation token: eos, and eot / eom where a model has them.
_EOG_KEYS = tuple(f"tokenizer.ggml.{kind}_token_id" for kind in ("eos", "eot", "eom"))
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# A Llama's q and k: llama.cpp permuted their rows per head (of this config count)
_PERMUTED = {"attn_q": "num_attention_heads", "attn_k": "num_key_value_heads"}
_ROPE_FREQS = "rope_freqs.weight"


@dataclass(frozen=True, slots=True)
class GGUFCheckpoint:
    config: dict[str, Any]
    tensors: dict[str, Tensor]

    @property
    def nbytes(self) -> int:
        """The weights' bytes as held: packed quantized values plus their scales and mins."""
        return sum(
            t.nbytes if isinstance(t, QuantizedWeight) else t.numel() * t.element_size()
            for t in self.tensors.values()
        )


def load_gguf(path: Path | str) -> GGUFCheckpoint:
    reader = GGUFReader(path)
    config = read_config(reader)
    return GGUFCheckpoint(config, read_tensors(reader, config))


def architecture(reader: GGUFReader) -> str:
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        supported = ", ".join(ARCHITECTURES)
        raise ValueError(f"GGUF architecture {arch!r} is not supported ({supported})")
    return str(arch)


def read_config(source: GGUFReader | Path | str) -> dict[str, Any]:
    """The Hugging Face config.json a checkpoint of this model would carry, from the metadata."""
    reader = source if isinstance(source, GGUFReader) else GGUFReader(source)
    arch = architecture(reader)
    model_type, class_name, _ = ARCHITECTURES[arch]
    config: dict[str, Any] = {"architectures": [class_name], "model_type": model_type}
    for key, name in _CONFIG_KEYS.items():
        value = _field(reader, f"{arch}.{key}")
        if isinstance(value, list):  # per-layer head counts (e.g. OpenELM): not these models
            raise ValueError(f"GGUF {arch}.{key} varies per layer; not supported")
        if value is not None:
            config[name] = value
    config.setdefault("num_key_value_heads", config["num_attention_heads"])
    if "head_dim" not in config and arch == "llama":  # Llama rotates whole heads
        head_dim = _field(reader, "llama.rope.dimension_count")
        if head_dim is not None:
            config["head_dim"] = head_dim
    if "vocab_size" not in config:
        config["vocab_size"] = len(reader.fields["tokenizer.ggml.tokens"].data)
    names = {tensor.name for tensor in reader.tensors}
    config["tie_word_embeddings"] = "output.weight" not in names
    config["attention_bias"] = "blk.0.attn_q.bias" in names
    for key, name in _TOKEN_KEYS.items():
        if (value := _field(reader, key)) is not None:
            config[name] = value
    eog = list(dict.fromkeys(v for k in _EOG_KEYS if (v := _field(reader, k)) is not None))
    if eog:
        config["eos_token_id"] = eog[0] if len(eog) == 1 else eog
    rope_scaling = _rope_scaling(reader, arch, config)
    if rope_scaling:
        config["rope_scaling"] = rope_scaling
    return config


def read_tensors(reader: GGUFReader, config: dict[str, Any]) -> dict[str, Tensor]:
    """Every tensor under its Hugging Face name; q / k rows of a Llama put back in HF order."""
    arch = architecture(reader)
    tensors: dict[str, Tensor] = {}
    for tensor in reader.tensors:
        if tensor.name == _ROPE_FREQS:  # in the config (read_config)
            continue
        data = tensor.data
        heads = permuted_heads(arch, tensor.name, config)
        if heads is not None:  # rows of blocks: a quantized matrix stays quantized
            data = data[_unpermute_rows(data.shape[0], heads)]
        tensors[hf_name(tensor.name)] = _tensor(tensor.name, data, tensor.tensor_type)
    return tensors


def hf_name(gguf_name: str) -> str:
    """blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight, token_embd.weight -> ..."""
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[parts[0]]}.{parts[1]}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face name here")


def permuted_heads(arch: str, gguf_name: str, config: dict[str, Any]) -> int | None:
    """The heads whose rows llama.cpp permuted in this tensor (a Llama's q / k), else None."""
    count = _PERMUTED.get(gguf_name.split(".")[-2]) if ARCHITECTURES[arch][2] else None
    return None if count is None else int(config[count])


def permute_rows(num_rows: int, num_heads: int) -> np.ndarray:
    """llama.cpp's order of a Llama q / k projection's rows: gguf_rows = hf_rows[permute_rows]."""
    half = num_rows // num_heads // 2
    # (heads, 2 rotary halves, half) -> (heads, half, 2): the halves interleaved
    return np.arange(num_rows).reshape(num_heads, 2, half).transpose(0, 2, 1).reshape(-1)


def _unpermute_rows(num_rows: int, num_heads: int) -> np.ndarray:
    """hf_rows = gguf_rows[_unpermute_rows]: the inverse of permute_rows."""
    return np.argsort(permute_rows(num_rows, num_heads))


def _tensor(name: str, data: np.ndarray, qtype: GGMLQuantizationType) -> Tensor:
    if qtype in LAYOUTS:
        if data.ndim != 2:
            raise ValueError(f"GGUF {name}: quantized {data.ndim}-d tensors are not supported")
        return unpack_blocks(data, qtype)
    if qtype in (Q.F32, Q.F16):
        return torch.from_numpy(np.array(data))  # a copy: the reader's map is read-only
    if qtype == Q.BF16:  # mapped as bytes, two per value
        return torch.from_numpy(np.array(data)).view(torch.bfloat16)
    raise ValueError(f"GGUF {name}: type {qtype.name} is not supported")


def _rope_scaling(reader: GGUFReader, arch: str, config: dict[str, Any]) -> dict[str, Any]:
    kind = _field(reader, f"{arch}.rope.scaling.type")
    factor = _field(reader, f"{arch}.rope.scaling.factor")
    original = _field(reader, f"{arch}.rope.scaling.original_context_length")
    freqs = next((t for t in reader.tensors if t.name == _ROPE_FREQS), None)
    if freqs is not None:
        if freqs.tensor_type != Q.F32:
            raise ValueError(f"GGUF {_ROPE_FREQS} is {freqs.tensor_type.name}, not F32")
        divisors = [float(f) for f in np.asarray(freqs.data, dtype=np.float32).reshape(-1)]
        return {
            "rope_type": "longrope",
            "short_factor": divisors,
            "long_factor": divisors,
            "factor": 1.0,
            "attention_factor": 1.0,
            "original_max_position_embeddings": config.get("max_position_embeddings", 8192),
        }
    if kind in (None, "none"):
        return {}
    if kind not in ("linear", "yarn"):
        raise ValueError(f"GGUF rope scaling {kind!r} is not supported (linear, yarn)")
    scaling: dict[str, Any] = {"rope_type": kind, "factor": float(factor or 1.0)}
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def _field(reader: GGUFReader, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()
