"""Llama / Qwen2 / Qwen3 decoder over the paged KV cache.

Module and parameter names mirror Hugging Face's so safetensors checkpoints load by name. The
forward pass works on a flat batch of tokens (prefill chunks and decode tokens of many sequences
together); `AttentionMetadata` says which tokens belong to whom and where their K/V live in the
cache.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from engine import attention
from engine.kernels import cpu_kernels
from engine.linear import Linear
from engine.model_config import ModelConfig, RopeConfig


@dataclass(slots=True)
class AttentionMetadata:
    """Token layout of one forward pass: the first `num_decode_tokens` tokens are decodes (one per
    sequence), the rest are prefill chunks packed back to back."""

    slot_mapping: torch.Tensor  # (num_tokens,) int64: block_id * block_size + offset
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # (num_decodes, max_blocks) int32
    decode_context_lens: torch.Tensor  # (num_decodes,) int32, counting the new token
    prefill_block_tables: torch.Tensor  # (num_prefills, max_blocks) int32
    prefill_cu_seqlens_q: torch.Tensor  # (num_prefills + 1,) int32
    prefill_context_lens: torch.Tensor  # (num_prefills,) int32, prefix + chunk
    backend: attention.AttentionBackend = "auto"
    shared: dict[str, object] = field(default_factory=dict)  # per pass, see decode_attention


class RMSNorm(nn.Module):
    fused = False  # the C kernel (kernels/cpu_kernels.c), set by use_cpu_kernels

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return cpu_kernels.rms_norm(x, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder's skip connection and the next norm: (norm(residual + x), residual + x)."""
        if self.fused:
            residual = residual.contiguous()
            return cpu_kernels.rms_norm(x, self.weight, self.eps, residual), residual
        residual = residual + x
        return self(residual), residual


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, computed once in float32 as Hugging Face does."""

    fused = False  # the C kernel, in place (kernels/cpu_kernels.c), set by use_cpu_kernels

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig) -> None:
        super().__init__()
        inv_freq = _inv_freq(head_dim, rope)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)  # (max_positions, head_dim)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fused and q.stride(-2) == q.shape[-1] and k.stride(-2) == k.shape[-1]:
            cpu_kernels.rope_(q, positions, self.cos, self.sin)
            cpu_kernels.rope_(k, positions, self.cos, self.sin)
            return q, k
        cos = self.cos[positions][:, None, :]  # (num_tokens, 1, head_dim)
        sin = self.sin[positions][:, None, :]
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated * sin).to(x.dtype)


def _inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if rope.kind == "linear":
        return inv_freq / rope.factor
    if rope.kind == "llama3":
        low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
        high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d, bias = config.head_dim, config.attention_bias
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d
        # q, k and v in one matmul (the checkpoint's q_proj, k_proj, v_proj, stacked at load)
        self.qkv_proj = Linear(config.hidden_size, (config.num_heads + 2 * config.num_kv_heads) * d,
                               bias=bias)  # fmt: skip
        self.o_proj = Linear(config.num_heads * d, config.hidden_size, bias=False)
        self.qk_norm = config.qk_norm
        if config.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.k_norm = RMSNorm(d, config.rms_norm_eps)
        self.scale = d**-0.5
        self.sliding_window = config.sliding_window

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(positions, q, k)
        k_cache, v_cache = kv_cache
        attention.write_kv(k, v, k_cache, v_cache, meta.slot_mapping, backend=meta.backend)
        out = self._attend(q, k_cache, v_cache, meta)  # (num_tokens, num_heads, head_dim)
        return self.o_proj(out.reshape(num_tokens, -1))

    def _attend(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        nd = meta.num_decode_tokens
        parts = []
        if nd:
            parts.append(
                attention.decode_attention(
                    q[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
                    self.scale, sliding_window=self.sliding_window, backend=meta.backend,
                    shared=meta.shared,
                )
            )  # fmt: skip
        if nd < q.shape[0]:
            parts.append(
                attention.prefill_attention(
                    q[nd:], k_cache, v_cache, meta.prefill_block_tables, meta.prefill_cu_seqlens_q,
                    meta.prefill_context_lens, self.scale, sliding_window=self.sliding_window,
                    backend=meta.backend,
                )
            )  # fmt: skip
        return parts[0] if len(parts) == 1 else torch.cat(parts)


class MLP(nn.Module):
    fused = False  # silu(gate) * up as the C kernel (kernels/cpu_kernels.c), set by use_cpu_kernels

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        # gate and up in one matmul (the checkpoint's gate_proj and up_proj, stacked at load)
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return self.down_proj(cpu_kernels.silu_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it): the skip connection is
        added by the next norm, the layer's or the next layer's, in one pass with it."""
        if residual is None:  # the first layer: the stream is the embeddings
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm.add_and_norm(x, residual)
        x = self.self_attn(x, positions, rotary, kv_cache, meta)
        x, residual = self.post_attention_layernorm.add_and_norm(x, residual)
        return self.mlp(x), residual


class DecoderBody(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """The whole decoder: `forward` returns hidden states, `logits` projects the selected rows."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderBody(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope)
        # decode-only batches of up to this many sequences run as one C call (use_c_decode_step)
        self.c_decode_max_rows = 0
        self.c_decode_pairs = False  # its weights in bfloat16 pairs (kernels/cpu_linear.c)
        self._decode_layers: tuple[int, ctypes.Array[cpu_kernels.DecodeLayer]] | None = None

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)  # (num_tokens, hidden)
        if 0 < meta.num_decode_tokens == x.shape[0] <= self.c_decode_max_rows:
            return self._decode_in_c(x, positions, kv_caches, meta)
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, positions, self.rotary, kv_cache, meta)
        assert residual is not None, "a model has at least one layer"
        return self.model.norm.add_and_norm(x, residual)[0]

    def _decode_in_c(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """`forward` of a decode-only batch as one C call (kernels/cpu_decode_step.c)."""
        k_cache = kv_caches[0][0]
        if self._decode_layers is None or self._decode_layers[0] != k_cache.data_ptr():
            self._decode_layers = (k_cache.data_ptr(), self._layer_table(kv_caches))
        c = self.config
        shape = cpu_kernels.DecodeShape(
            hidden=c.hidden_size, intermediate=c.intermediate_size, num_heads=c.num_heads,
            num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, block_size=k_cache.shape[1],
            block_stride=k_cache.stride(0), window=c.sliding_window or 0, eps=c.rms_norm_eps,
            scale=c.head_dim**-0.5, soft_cap=0.0, pairs=self.c_decode_pairs,
        )  # fmt: skip
        return cpu_kernels.decode_step(
            self._decode_layers[1], shape, x.contiguous(), self.model.norm.weight, positions,
            meta.slot_mapping, meta.decode_block_tables, meta.decode_context_lens,
            self.rotary.cos, self.rotary.sin,
        )  # fmt: skip

    def _layer_table(
        self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> ctypes.Array[cpu_kernels.DecodeLayer]:
        """Every layer's tensors for the C pass, by address (they live as long as the model and
        the KV cache do)."""

        def address(t: torch.Tensor | None) -> int | None:
            return None if t is None else t.data_ptr()

        table = (cpu_kernels.DecodeLayer * len(self.model.layers))()
        for entry, layer, (k, v) in zip(table, self.model.layers, kv_caches, strict=True):
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

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()  # (num_rows, vocab_size)


def use_cpu_kernels(model: CausalLM) -> None:
    """Run the norms, the rotary embedding and the MLP's activation as the C kernels (CPU,
    float32 / bfloat16, where the kernels built; see kernels/cpu_kernels.py): same maths, one
    pass each."""
    for module in model.modules():
        if isinstance(module, (RMSNorm, RotaryEmbedding, MLP)):
            module.fused = True


def _decode_tensors(linear: Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    tensors = linear.decode_tensors()
    assert tensors is not None, "use_c_decode_step checked that every layer has them"
    return tensors


# Beside oneDNN's bfloat16 layers, without the kernels' bfloat16 pairs: the batch size up to
# which the C step (panels widened to float32) is faster than oneDNN's dot products (linear.py).
C_DECODE_MAX_ROWS_BESIDE_ONEDNN = 4


def use_c_decode_step(model: CausalLM) -> bool:
    """Run decode-only batches as one C call where the C pass computes what `forward` would:
    every layer's weights in panels, or a copy beside oneDNN's (in bfloat16 pairs: any batch;
    in panels: small batches only), the C norms and rotary on, no per-head norms (Qwen3)."""
    layers = [m for m in model.modules() if isinstance(m, Linear) and m is not model.lm_head]
    copies = [m.decode_copy[0] for m in layers if m.decode_copy is not None]
    model.c_decode_pairs = len(copies) == len(layers) and all(t.dim() == 4 for t in copies)
    if all(m.layout == "panels" for m in layers) or model.c_decode_pairs:
        max_rows = 1 << 30
    elif len(copies) == len(layers):
        max_rows = C_DECODE_MAX_ROWS_BESIDE_ONEDNN
    else:
        max_rows = 0
    runs = model.model.norm.fused and not model.config.qk_norm
    model.c_decode_max_rows = max_rows if runs else 0
    return model.c_decode_max_rows > 0


def load_model(model_dir: Path, config: ModelConfig, dtype: torch.dtype) -> CausalLM:
    """Build the module on the meta device and assign the checkpoint's tensors: no double memory."""
    with torch.device("meta"):
        model = CausalLM(config)
    state: dict[str, torch.Tensor] = {}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights")
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if "rotary_emb" not in name:  # old Llama checkpoints store inv_freq
                    state[name] = f.get_tensor(name).to(dtype)
    if config.tie_word_embeddings or "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    _stack(state, ("q_proj", "k_proj", "v_proj"), "qkv_proj")
    _stack(state, ("gate_proj", "up_proj"), "gate_up_proj")
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise ValueError(
            f"{model_dir}: checkpoint mismatch, missing={missing} unexpected={unexpected}"
        )
    model.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope)
    return model.eval()


def _stack(state: dict[str, torch.Tensor], parts: tuple[str, ...], fused: str) -> None:
    """Checkpoint projections that the model runs as one matmul: their weights (and biases)
    stacked along the output dimension, in `parts` order, under the fused name."""
    first = f".{parts[0]}."
    for name in [n for n in state if first in n]:
        prefix, _, kind = name.rpartition(first)  # kind: weight or bias
        tensors = [state.pop(f"{prefix}.{part}.{kind}") for part in parts]
        state[f"{prefix}.{fused}.{kind}"] = torch.cat(tensors)
