"""The CPU fast path of a model: its norms, rotary and activation as the C kernels, and decode-only
batches as one C call (kernels/cpu_decode_step.c) where that pass computes what `forward` would.

The C step strings the same kernels together in the same order; it covers the layers it knows
(see `c_step_runs`), and a model with any other layer keeps the Python forward.
"""

from __future__ import annotations

import ctypes

import torch

from engine.kernels import cpu_kernels
from engine.linear import Linear
from engine.models.decoder import CausalLM, PreNormDecoderLayer
from engine.models.layers import AttentionMetadata, GatedMLP, GemmaRMSNorm, RMSNorm, RotaryEmbedding

# Beside oneDNN's bfloat16 layers, without the kernels' bfloat16 pairs: the batch size up to
# which the C step (panels widened to float32) is faster than oneDNN's dot products (linear.py).
C_DECODE_MAX_ROWS_BESIDE_ONEDNN = 4


def use_cpu_kernels(model: CausalLM) -> None:
    """Run the norms, the rotary embedding and the MLP's activation as the C kernels (CPU,
    float32 / bfloat16, where the kernels built; see kernels/cpu_kernels.py): same maths, one
    pass each."""
    for module in model.modules():
        if isinstance(module, (RMSNorm, RotaryEmbedding, GatedMLP)):
            module.fused = True


def c_step_runs(model: CausalLM) -> bool:
    """Whether cpu_decode_step.c computes this model's forward: Llama-style pre-norm layers with a
    dense SiLU MLP, no per-head norms, sinks or output bias, one rotary table over whole heads,
    and one sliding window for every layer."""
    config = model.config
    windows = {config.window(i) for i in range(config.num_layers)}
    if len(model.rotaries) != 1 or len(windows) != 1 or model.embedding_multiplier is not None:
        return False
    rotary = model.rotaries[0]
    if rotary.long_offset or rotary.rotary_dim != config.head_dim:
        return False
    for layer in model.model.layers:
        if not isinstance(layer, PreNormDecoderLayer) or not isinstance(layer.mlp, GatedMLP):
            return False
        attn = layer.self_attn
        if attn.qk_norm or attn.sinks is not None or attn.o_proj.bias is not None:
            return False
        if layer.mlp.activation != "silu":
            return False
    return not isinstance(model.model.norm, GemmaRMSNorm)


def use_c_decode_step(model: CausalLM) -> bool:
    """Run decode-only batches as one C call where the C pass computes what `forward` would:
    every layer's weights in panels, or a copy beside oneDNN's (in bfloat16 pairs: any batch;
    in panels: small batches only), the C norms and rotary on."""
    layers = [m for m in model.modules() if isinstance(m, Linear) and m is not model.lm_head]
    copies = [m.decode_copy[0] for m in layers if m.decode_copy is not None]
    model.c_decode_pairs = len(copies) == len(layers) and all(t.dim() == 4 for t in copies)
    if all(m.layout == "panels" for m in layers) or model.c_decode_pairs:
        max_rows = 1 << 30
    elif len(copies) == len(layers):
        max_rows = C_DECODE_MAX_ROWS_BESIDE_ONEDNN
    else:
        max_rows = 0
    runs = model.model.norm.fused and c_step_runs(model)
    model.c_decode_max_rows = max_rows if runs else 0
    return model.c_decode_max_rows > 0


def decode_in_c(
    model: CausalLM,
    x: torch.Tensor,
    positions: torch.Tensor,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    meta: AttentionMetadata,
) -> torch.Tensor:
    """`forward` of a decode-only batch as one C call (kernels/cpu_decode_step.c)."""
    k_cache = kv_caches[0][0]
    if model._decode_layers is None or model._decode_layers[0] != k_cache.data_ptr():
        model._decode_layers = (k_cache.data_ptr(), _layer_table(model, kv_caches))
    c = model.config
    rotary = model.rotaries[0]
    shape = cpu_kernels.DecodeShape(
        hidden=c.hidden_size, intermediate=c.intermediate_size, num_heads=c.num_heads,
        num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, block_size=k_cache.shape[1],
        block_stride=k_cache.stride(0), window=c.window(0) or 0, eps=c.rms_norm_eps,
        scale=c.scale, soft_cap=c.attn_soft_cap or 0.0, pairs=model.c_decode_pairs,
    )  # fmt: skip
    return cpu_kernels.decode_step(
        model._decode_layers[1], shape, x.contiguous(), model.model.norm.weight, positions,
        meta.slot_mapping, meta.decode_block_tables, meta.decode_context_lens,
        rotary.cos, rotary.sin,
    )  # fmt: skip


def _layer_table(
    model: CausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
) -> ctypes.Array[cpu_kernels.DecodeLayer]:
    """Every layer's tensors for the C pass, by address (they live as long as the model and
    the KV cache do)."""

    def address(t: torch.Tensor | None) -> int | None:
        return None if t is None else t.data_ptr()

    table = (cpu_kernels.DecodeLayer * len(model.model.layers))()
    for entry, layer, (k, v) in zip(table, model.model.layers, kv_caches, strict=True):
        attn, mlp = layer.self_attn, layer.mlp
        qkv, o = _decode_tensors(attn.qkv_proj), _decode_tensors(attn.o_proj)
        gate_up, down = _decode_tensors(mlp.gate_up_proj), _decode_tensors(mlp.down_proj)
        entry.qkv, entry.qkv_bias = address(qkv[0]), address(qkv[1])
        entry.o, entry.gate_up, entry.down = (
            address(o[0]),
            address(gate_up[0]),
            address(down[0]),
        )
        entry.input_norm = address(layer.input_layernorm.weight)
        entry.post_norm = address(layer.post_attention_layernorm.weight)
        entry.k_cache, entry.v_cache = address(k), address(v)
    return table


def _decode_tensors(linear: Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    tensors = linear.decode_tensors()
    assert tensors is not None, "use_c_decode_step checked that every layer has them"
    return tensors
