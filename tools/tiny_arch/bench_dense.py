"""builtin:qwen2.5-0.5b-bench, builtin:qwen3-0.6b-bench and builtin:llama-3.2-1b-bench: the exact
shapes of Qwen2.5-0.5B, Qwen3-0.6B and Llama-3.2-1B (config.json as the Hub has them: layers,
widths, heads, biases, q/k norms, rope, tied embeddings, vocabulary size) with random weights, for
benchmarks only (bench/peers.py against vLLM): what a step costs at a realistic size depends on
the shapes, not on what the weights know (the weights: tools/tiny_arch/random_checkpoint.py).

    orchestrator build-model builtin:llama-3.2-1b-bench --dtype bfloat16   # ~1 min, 2.5 GB

The tokenizer is SmolLM2's (its byte-level BPE, ChatML template and ids; taken from
builtin:smollm2-135m's build), grown to the model's vocabulary with filler tokens
`<|filler_N|>`: non-special added tokens, so any id a random model samples decodes, and the text
it decodes to encodes back to the same ids. Prompts tokenize as SmolLM2's do (ids below 49,152).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from common.model_cache import progress
from tools.tiny_arch.random_checkpoint import write_random_weights
from tools.tiny_model.build import write_json

SEED = 20261207
SMOLLM2_VOCAB = 49152
# Each shape's layout scaled down (build_dense_bench's `overrides`): every kind of tensor, a CPU
# forward in milliseconds, a few filler tokens past SmolLM2's; for tests and GPU dry runs
SMALL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": SMOLLM2_VOCAB + 64,
}
BOS_ID, EOS_ID = 1, 2  # SmolLM2's <|im_start|>, <|im_end|>


@dataclass(frozen=True, slots=True)
class DenseShape:
    """A dense decoder's config.json fields (the Hub's, token ids aside)."""

    name: str
    config: dict[str, object]
    parameters: int  # the real model's count, which the shapes must give

    @property
    def qkv_bias(self) -> bool:
        return self.config["model_type"] == "qwen2"

    @property
    def qk_norm(self) -> bool:
        return self.config["model_type"] == "qwen3"


_COMMON = {
    "hidden_act": "silu",
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "tie_word_embeddings": True,
    "use_cache": True,
}
SHAPES = {
    shape.name: shape
    for shape in (
        DenseShape(
            name="qwen2.5-0.5b",
            parameters=494_032_768,
            config={
                "architectures": ["Qwen2ForCausalLM"],
                "model_type": "qwen2",
                "hidden_size": 896,
                "intermediate_size": 4864,
                "num_hidden_layers": 24,
                "num_attention_heads": 14,
                "num_key_value_heads": 2,
                "max_position_embeddings": 32768,
                "max_window_layers": 24,
                "rms_norm_eps": 1e-6,
                "rope_theta": 1_000_000.0,
                "sliding_window": 32768,
                "use_sliding_window": False,
                "vocab_size": 151936,
            },
        ),
        DenseShape(
            name="qwen3-0.6b",
            parameters=596_049_920,
            config={
                "architectures": ["Qwen3ForCausalLM"],
                "model_type": "qwen3",
                "attention_bias": False,
                "head_dim": 128,
                "hidden_size": 1024,
                "intermediate_size": 3072,
                "num_hidden_layers": 28,
                "num_attention_heads": 16,
                "num_key_value_heads": 8,
                "max_position_embeddings": 40960,
                "max_window_layers": 28,
                "rms_norm_eps": 1e-6,
                "rope_theta": 1_000_000.0,
                "rope_scaling": None,
                "sliding_window": None,
                "use_sliding_window": False,
                "vocab_size": 151936,
            },
        ),
        DenseShape(
            name="llama-3.2-1b",
            parameters=1_235_814_400,
            config={
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "attention_bias": False,
                "mlp_bias": False,
                "head_dim": 64,
                "hidden_size": 2048,
                "intermediate_size": 8192,
                "num_hidden_layers": 16,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "max_position_embeddings": 131072,
                "rms_norm_eps": 1e-5,
                "rope_theta": 500_000.0,
                "rope_scaling": {
                    "factor": 32.0,
                    "high_freq_factor": 4.0,
                    "low_freq_factor": 1.0,
                    "original_max_position_embeddings": 8192,
                    "rope_type": "llama3",
                },
                "vocab_size": 128256,
            },
        ),
    )
}


def model_config(shape: DenseShape, dtype: str, overrides: dict[str, int] | None = None) -> dict:
    """config.json: the Hub's fields (`overrides`: a test's smaller sizes), SmolLM2's token ids."""
    return {
        **_COMMON,
        **shape.config,
        **(overrides or {}),
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": EOS_ID,
        "torch_dtype": dtype,
    }


def tensor_shapes(shape: DenseShape, config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint (tied: no lm_head), in name order."""
    hidden, vocab = int(config["hidden_size"]), int(config["vocab_size"])
    heads, kv_heads = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    inter = int(config["intermediate_size"])
    q, kv = heads * head_dim, kv_heads * head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
    }
    for i in range(int(config["num_hidden_layers"])):
        layer = f"model.layers.{i}"
        shapes |= {
            f"{layer}.input_layernorm.weight": (hidden,),
            f"{layer}.post_attention_layernorm.weight": (hidden,),
            f"{layer}.self_attn.q_proj.weight": (q, hidden),
            f"{layer}.self_attn.k_proj.weight": (kv, hidden),
            f"{layer}.self_attn.v_proj.weight": (kv, hidden),
            f"{layer}.self_attn.o_proj.weight": (hidden, q),
            f"{layer}.mlp.gate_proj.weight": (inter, hidden),
            f"{layer}.mlp.up_proj.weight": (inter, hidden),
            f"{layer}.mlp.down_proj.weight": (hidden, inter),
        }
        if shape.qkv_bias:
            shapes |= {
                f"{layer}.self_attn.q_proj.bias": (q,),
                f"{layer}.self_attn.k_proj.bias": (kv,),
                f"{layer}.self_attn.v_proj.bias": (kv,),
            }
        if shape.qk_norm:
            shapes |= {
                f"{layer}.self_attn.q_norm.weight": (head_dim,),
                f"{layer}.self_attn.k_norm.weight": (head_dim,),
            }
    return dict(sorted(shapes.items()))


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def write_tokenizer(path: Path, vocab_size: int, source: Path | None = None) -> None:
    """SmolLM2's tokenizer files, its tokenizer.json grown to `vocab_size` (module docstring).
    `source`: a directory holding SmolLM2's TOKENIZER_FILES (a machine without internet, which
    cannot build builtin:smollm2-135m: bench/gpu_checkpoint.py); None: that builtin's build."""
    if source is None:
        from engine.builtin_build import ensure_builtin

        source = ensure_builtin("builtin:smollm2-135m")
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        shutil.copyfile(source / name, path / name)
    tokenizer = json.loads((source / "tokenizer.json").read_text(encoding="utf-8"))
    assert len(tokenizer["model"]["vocab"]) == SMOLLM2_VOCAB
    tokenizer["added_tokens"] += [
        {
            "id": i,
            "content": f"<|filler_{i}|>",
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": False,
        }
        for i in range(SMOLLM2_VOCAB, vocab_size)
    ]
    (path / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False), "utf-8")


def build_dense_bench(
    path: Path,
    name: str,
    *,
    dtype: str = "float32",
    overrides: dict[str, int] | None = None,
    tokenizer_source: Path | None = None,
) -> Path:
    """Write builtin:<name>-bench (or its layout at a test's smaller `overrides`) into `path`;
    `tokenizer_source`: as write_tokenizer's `source`."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    shape = SHAPES[name]
    config = model_config(shape, dtype, overrides)
    write_json(path / "config.json", config)
    generation = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": EOS_ID}
    write_json(path / "generation_config.json", {**generation, "do_sample": False})
    write_tokenizer(path, int(config["vocab_size"]), tokenizer_source)
    label = f"{name}-bench"
    total_bytes = write_random_weights(path, tensor_shapes(shape, config), dtype, SEED, label)
    progress(f"{label}: {total_bytes:,} bytes")
    return path


def qwen2_5_0_5b(path: Path, *, dtype: str = "float32") -> Path:
    return build_dense_bench(path, "qwen2.5-0.5b", dtype=dtype)


def qwen3_0_6b(path: Path, *, dtype: str = "float32") -> Path:
    return build_dense_bench(path, "qwen3-0.6b", dtype=dtype)


def llama_3_2_1b(path: Path, *, dtype: str = "float32") -> Path:
    return build_dense_bench(path, "llama-3.2-1b", dtype=dtype)
