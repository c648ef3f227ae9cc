"""Gemma 2 and Gemma 3 (text): a norm on each side of attention and of the MLP ("sandwich"),
Gemma's (1 + w) RMSNorm, embeddings scaled by sqrt(hidden_size), tanh-approximated GELU, the
attention scale from query_pre_attn_scalar, and sliding-window layers alternating with global
ones (Gemma 2: every other layer; Gemma 3: five of six, with their own rotary base). Gemma 2 caps
attention scores and logits (soft caps); Gemma 3 normalises q and k per head instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.model_config import ModelConfig, RopeConfig, base_fields, rope_config
from engine.models import Architecture, llama
from engine.models.checkpoint import State, rename
from engine.models.decoder import CausalLM
from engine.models.layers import (
    Attention,
    AttentionMetadata,
    GatedMLP,
    GemmaRMSNorm,
    RotaryEmbedding,
)


class GemmaDecoderLayer(nn.Module):
    """x + post_attn_norm(attn(input_norm(x))), then + post_ffn_norm(mlp(pre_ffn_norm(.)))."""

    def __init__(self, config: ModelConfig, layer: int, rope: RopeConfig) -> None:
        super().__init__()
        qk_norm = GemmaRMSNorm if config.qk_norm else None
        self.self_attn = Attention(config, config.window(layer), qk_norm)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_activation)
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.rope = rope

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:  # the first layer: the stream is the embeddings
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm.add_and_norm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(x, positions, rotary, kv_cache, meta))
        x, residual = self.pre_feedforward_layernorm.add_and_norm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


def _layer_types(raw: dict[str, Any], num_layers: int) -> list[str]:
    types = raw.get("layer_types")
    if types:
        return list(types)
    if raw.get("model_type") == "gemma2":
        return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
    pattern = int(raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6)
    return [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)
    ]


def read_config(model_dir: Path, raw: dict[str, Any]) -> ModelConfig:
    """`raw` is the language model's config with its class's defaults (common/hf_config.py):
    a multimodal Gemma 3's text_config too."""
    fields = base_fields(model_dir, raw)
    gemma2 = raw.get("model_type") == "gemma2"
    types = _layer_types(raw, fields["num_layers"])
    window = int(raw["sliding_window"]) if raw.get("sliding_window") else None
    local_rope = None
    if not gemma2:  # Gemma 3: per layer type rotary parameters (transformers 5), else 4.x's keys
        fields["rope"] = rope_config(raw, "full_attention", default_theta=1_000_000.0)
        if "sliding_attention" in (raw.get("rope_parameters") or {}):
            local_rope = rope_config(raw, "sliding_attention")
        else:  # 4.x: rope_scaling is the global layers' only; local ones plain, their own base
            local_rope = RopeConfig(theta=float(raw.get("rope_local_base_freq", 10_000.0)))
    fields.update(
        qk_norm=not gemma2,
        o_proj_bias=fields["attention_bias"],
        sliding_window=window,
        layer_windows=tuple(window if t == "sliding_attention" else None for t in types),
        local_rope=local_rope,
        attention_scale=float(raw.get("query_pre_attn_scalar") or fields["head_dim"]) ** -0.5,
        attn_soft_cap=raw.get("attn_logit_softcapping"),
        final_soft_cap=raw.get("final_logit_softcapping"),
        hidden_activation=_activation(raw),
        tie_word_embeddings=raw.get("tie_word_embeddings", True),
    )
    return ModelConfig(**fields)


def _activation(raw: dict[str, Any]) -> str:
    name = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if name not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"Gemma with activation {name!r} is not supported (gelu_pytorch_tanh)")
    return "gelu_tanh"


def build(config: ModelConfig) -> CausalLM:
    layers = []
    for i in range(config.num_layers):
        local = config.window(i) is not None and config.local_rope is not None
        layers.append(GemmaDecoderLayer(config, i, config.local_rope if local else config.rope))
    norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
    return CausalLM(config, layers, norm, embedding_multiplier=config.hidden_size**0.5)


def convert(state: State, config: ModelConfig) -> None:
    """Multimodal Gemma 3 checkpoints keep the text model under language_model; the vision tower
    is not served (issue 34) and is dropped."""
    for name in [n for n in state if "vision_tower" in n or "multi_modal_projector" in n]:
        del state[name]
    rename(state, r"^(?:model\.)?language_model\.(?:model\.)?", "model.")
    llama.convert(state, config)


ARCHITECTURE = Architecture(
    "Gemma 2 / Gemma 3", ("gemma2", "gemma3_text", "gemma3"), read_config, build, convert
)
