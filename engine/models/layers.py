"""The layers every architecture is built from: norms, rotary embedding, paged attention, the
gated MLP. Architecture modules (llama.py, gemma.py, ...) compose them; what differs between
architectures is passed to the constructors, never read from a global.

The forward pass works on a flat batch of tokens (prefill chunks and decode tokens of many
sequences together); `AttentionMetadata` says which tokens belong to whom and where their K/V
live in the cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from engine import attention
from engine.kernels import cpu_kernels
from engine.linear import Linear
from engine.model_config import ModelConfig, RopeConfig
from engine.models.rope import cos_sin_tables


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
    # (num_tokens,) int64: each token's sequence length as longrope picks its table by: the
    # length once this pass ends, or the whole prompt's while a prompt is prefilled in chunks
    # (as transformers, which runs a prompt in one pass); None: not needed by the model
    rope_seq_lens: torch.Tensor | None = None


class RMSNorm(nn.Module):
    """Llama's RMSNorm: normalised in float32, rounded to the dtype, times the weight."""

    fused = False  # the C kernel (kernels/cpu_kernels.c), set by use_cpu_kernels
    gemma = False  # Gemma's maths (GemmaRMSNorm)

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return cpu_kernels.rms_norm(x, self.weight, self.eps, gemma=self.gemma)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder's skip connection and the next norm: (norm(residual + x), residual + x)."""
        if self.fused:
            residual = residual.contiguous()
            out = cpu_kernels.rms_norm(x, self.weight, self.eps, residual, gemma=self.gemma)
            return out, residual
        residual = residual + x
        return self(residual), residual

    def heads_(self, x: torch.Tensor) -> torch.Tensor:
        """x: (tokens, heads, head_dim) normalised per head (Qwen3's and Gemma 3's q / k norms),
        in place where the C kernel takes the view (q and k inside the fused qkv rows)."""
        if self.fused and x.stride(2) == 1 and x.stride(1) == x.shape[2]:
            cpu_kernels.rms_norm_heads_(x, self.weight, self.eps, self.gemma)
            return x
        return self(x)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the weight is stored as w - 1 and the product taken in float32,
    x * rsqrt(mean(x^2) + eps) * (1 + w), rounded once to the dtype."""

    gemma = True

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps)
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return cpu_kernels.rms_norm(x, self.weight, self.eps, gemma=True)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position (models/rope.py), applied in the rotate-half form."""

    fused = False  # the C kernel, in place (kernels/cpu_kernels.c), set by use_cpu_kernels

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int) -> None:
        super().__init__()
        cos, sin = cos_sin_tables(rope, head_dim, max_positions)
        self.register_buffer("cos", cos, persistent=False)  # (positions, rotary_dim)
        self.register_buffer("sin", sin, persistent=False)
        self.rotary_dim = cos.shape[1]
        self.head_dim = head_dim
        # longrope: rows [max, 2 max) hold the long factors' table
        self.long_offset = max_positions if rope.kind == "longrope" else 0
        self.original_max = rope.original_max_position_embeddings

    def table_positions(self, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The table row of each token: its position, or for longrope the long half's row once
        its sequence is longer than the pretraining length (Hugging Face switches a whole
        forward pass by its longest position; per sequence here)."""
        if not self.long_offset:
            return positions
        assert meta.rope_seq_lens is not None, "longrope needs each token's sequence length"
        return positions + (meta.rope_seq_lens > self.original_max).long() * self.long_offset

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fused and q.stride(-2) == q.shape[-1] and k.stride(-2) == k.shape[-1]:
            cpu_kernels.rope_(q, positions, self.cos, self.sin)
            cpu_kernels.rope_(k, positions, self.cos, self.sin)
            return q, k
        cos = self.cos[positions][:, None, :]  # (num_tokens, 1, rotary_dim)
        sin = self.sin[positions][:, None, :]
        if self.rotary_dim == self.head_dim:
            return _rotate(q, cos, sin), _rotate(k, cos, sin)
        r = self.rotary_dim
        q = torch.cat([_rotate(q[..., :r], cos, sin), q[..., r:]], dim=-1)
        k = torch.cat([_rotate(k[..., :r], cos, sin), k[..., r:]], dim=-1)
        return q, k


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    """Self-attention over the paged cache: q, k and v as one matmul (the checkpoint's projections
    stacked at load), optional per-head q/k norms, rotary, then the decode and prefill kernels.

    window: this layer's sliding window (None: full); soft_cap: Gemma 2's score cap; sinks:
    gpt-oss's per-head sink logits (a parameter when `config.attention_sinks`)."""

    def __init__(
        self,
        config: ModelConfig,
        window: int | None,
        qk_norm: type[RMSNorm] | None = None,
    ) -> None:
        super().__init__()
        d = config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d
        self.qkv_proj = Linear(config.hidden_size, (config.num_heads + 2 * config.num_kv_heads) * d,
                               bias=config.attention_bias)  # fmt: skip
        self.o_proj = Linear(config.num_heads * d, config.hidden_size, bias=config.o_proj_bias)
        self.qk_norm = qk_norm is not None
        if qk_norm is not None:
            self.q_norm = qk_norm(d, config.rms_norm_eps)
            self.k_norm = qk_norm(d, config.rms_norm_eps)
        self.sinks = nn.Parameter(torch.zeros(config.num_heads)) if config.attention_sinks else None
        self.scale = config.scale
        self.soft_cap = config.attn_soft_cap
        self.sliding_window = window

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
            q, k = self.q_norm.heads_(q), self.k_norm.heads_(k)
        q, k = rotary(positions, q, k)
        k_cache, v_cache = kv_cache
        attention.write_kv(k, v, k_cache, v_cache, meta.slot_mapping, backend=meta.backend)
        out = self._attend(q, k_cache, v_cache, meta)  # (num_tokens, num_heads, head_dim)
        return self.o_proj(out.reshape(num_tokens, -1))

    def _attend(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        nd = meta.num_decode_tokens
        sinks = None if self.sinks is None else self.sinks.float()
        parts = []
        if nd:
            parts.append(
                attention.decode_attention(
                    q[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
                    self.scale, self.sliding_window, self.soft_cap, sinks=sinks,
                    backend=meta.backend, shared=meta.shared,
                )
            )  # fmt: skip
        if nd < q.shape[0]:
            parts.append(
                attention.prefill_attention(
                    q[nd:], k_cache, v_cache, meta.prefill_block_tables, meta.prefill_cu_seqlens_q,
                    meta.prefill_context_lens, self.scale, self.sliding_window, self.soft_cap,
                    sinks=sinks, backend=meta.backend,
                )
            )  # fmt: skip
        return parts[0] if len(parts) == 1 else torch.cat(parts)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up as one matmul (stacked at load). act: SiLU
    (Llama, Qwen, Mistral, Phi-3) or tanh-approximated GELU (Gemma)."""

    fused = False  # act(gate) * up as the C kernel (kernels/cpu_kernels.c), set by use_cpu_kernels

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str = "silu") -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.activation = activation
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            gated = cpu_kernels.silu_mul if self.activation == "silu" else cpu_kernels.gelu_tanh_mul
            return self.down_proj(gated(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        if self.activation == "silu":
            act = nn.functional.silu(gate)
        else:
            act = nn.functional.gelu(gate, approximate="tanh")
        return self.down_proj(act * up)
