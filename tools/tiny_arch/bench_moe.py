"""builtin:qwen3-moe-bench: Qwen3-30B-A3B's architecture at ~470M parameters, random weights, for
benchmarks only (bench/peers.py against vLLM): what a decode step costs depends on the shapes and
on which experts the router picks, not on what the weights know.

    orchestrator build-model builtin:qwen3-moe-bench --dtype bfloat16   # ~15 s, 945 MB

Kept from Qwen3-30B-A3B (transformers' Qwen3MoeConfig): per-head q/k norms, every layer sparse,
128 experts with the top 8 renormalised (norm_topk_prob), so that a batch of B tokens touches the
same share of each layer's experts as there, 1 - (1 - 8/128)^B (bench/peers.py's bound); GQA,
head_dim 64, rope theta 1,000,000, untied LM head. Scaled: hidden 768 (2,048 there), 8 layers
(48), 12 query / 4 KV heads (32 / 4), experts 192 wide (768 there: a quarter of hidden against
three eighths, and wide enough that a call per expert is work, not dispatch). Fewer, fuller layers
rather than 12 of thinner experts: a step's cost per layer stays nearer the real model's. The
tokenizer is the tiny model's (4,096 tokens: tools/tiny_model/), not SmolLM2's 49,152: the LM
head is then ~7% of the bytes a one-token step reads, as Qwen3-30B-A3B's 151,936 x 2,048 head is
~9% of its 3.3B active parameters; with 49,152 tokens it would be nearly half, and this would
benchmark a dense matmul more than the experts.

The weights: tools/tiny_arch/random_checkpoint.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from common.model_cache import progress
from tools.tiny_arch.random_checkpoint import write_random_weights
from tools.tiny_model.build import (
    ENDOFTEXT_ID,
    IM_END_ID,
    VOCAB_SIZE,
    generation_config,
    write_json,
    write_tokenizer_files,
)

SEED = 20261206
# The benchmark's sizes (module docstring); a test builds the same layout smaller.
SIZES: dict[str, int] = {
    "hidden_size": 768,
    "num_hidden_layers": 8,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 192,
    "vocab_size": VOCAB_SIZE,
}


def model_config(sizes: Mapping[str, int], dtype: str) -> dict[str, object]:
    """config.json in the layout of Qwen3-30B-A3B's on the Hub (`num_experts`, `rope_theta`), which
    transformers 4 (vLLM's) and 5 (ours) both read."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        **sizes,
        "intermediate_size": 4 * sizes["hidden_size"],  # a dense MLP's; no layer has one
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "max_position_embeddings": 40960,
        "max_window_layers": sizes["num_hidden_layers"],
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "rope_scaling": None,
        "use_sliding_window": False,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "router_aux_loss_coef": 0.001,
        "output_router_logits": False,
        "initializer_range": 0.02,
        "bos_token_id": ENDOFTEXT_ID,
        "eos_token_id": IM_END_ID,
        "pad_token_id": ENDOFTEXT_ID,
        "use_cache": True,
        "torch_dtype": dtype,
    }


def tensor_shapes(sizes: Mapping[str, int]) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Qwen3MoeForCausalLM checkpoint, experts one by one as the Hub stores
    them, in name order."""
    hidden, head_dim, vocab = sizes["hidden_size"], sizes["head_dim"], sizes["vocab_size"]
    heads, kv_heads = sizes["num_attention_heads"], sizes["num_key_value_heads"]
    inter = sizes["moe_intermediate_size"]
    shapes: dict[str, tuple[int, ...]] = {
        "lm_head.weight": (vocab, hidden),
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
    }
    for i in range(sizes["num_hidden_layers"]):
        layer = f"model.layers.{i}"
        shapes |= {
            f"{layer}.input_layernorm.weight": (hidden,),
            f"{layer}.post_attention_layernorm.weight": (hidden,),
            f"{layer}.self_attn.q_proj.weight": (heads * head_dim, hidden),
            f"{layer}.self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            f"{layer}.self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            f"{layer}.self_attn.o_proj.weight": (hidden, heads * head_dim),
            f"{layer}.self_attn.q_norm.weight": (head_dim,),
            f"{layer}.self_attn.k_norm.weight": (head_dim,),
            f"{layer}.mlp.gate.weight": (sizes["num_experts"], hidden),
        }
        for e in range(sizes["num_experts"]):
            expert = f"{layer}.mlp.experts.{e}"
            shapes |= {
                f"{expert}.gate_proj.weight": (inter, hidden),
                f"{expert}.up_proj.weight": (inter, hidden),
                f"{expert}.down_proj.weight": (hidden, inter),
            }
    return dict(sorted(shapes.items()))


def parameter_count(sizes: Mapping[str, int]) -> int:
    """The checkpoint's parameters, by the architecture's formula."""
    hidden, head_dim, layers = sizes["hidden_size"], sizes["head_dim"], sizes["num_hidden_layers"]
    q = sizes["num_attention_heads"] * head_dim
    kv = sizes["num_key_value_heads"] * head_dim
    attention = 2 * hidden * q + 2 * hidden * kv + 2 * head_dim  # q, o, k, v; the q/k norms
    experts = sizes["num_experts"] * 3 * hidden * sizes["moe_intermediate_size"]
    layer = attention + experts + sizes["num_experts"] * hidden + 2 * hidden  # router, norms
    return layers * layer + 2 * sizes["vocab_size"] * hidden + hidden  # embedding, head, norm


def build_bench_moe(
    path: Path, *, dtype: str = "float32", sizes: Mapping[str, int] | None = None
) -> Path:
    """Write builtin:qwen3-moe-bench (or the same layout at `sizes`) into `path` in `dtype`."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    sizes = dict(sizes or SIZES)
    write_json(path / "config.json", model_config(sizes, dtype))
    write_json(path / "generation_config.json", {**generation_config(), "do_sample": False})
    write_tokenizer_files(path)
    total_bytes = write_random_weights(path, tensor_shapes(sizes), dtype, SEED, "qwen3-moe-bench")
    progress(f"qwen3-moe-bench: {parameter_count(sizes):,} parameters, {total_bytes:,} bytes")
    return path
