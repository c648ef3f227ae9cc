"""gpt-oss: attention with q/k/v/o biases and a learned sink logit per head, sliding-window layers
alternating with full ones, YaRN rotary scaling, and a mixture of experts on every layer (the top
k router logits, then a softmax over them; experts with biases and gpt-oss's clamped SwiGLU,
(up + 1) * gate * sigmoid(1.702 gate)). Its chat format is harmony (the frontend's renderer and
the postproc pool's parser), not a Jinja template.

Checkpoints keep the experts as (E, hidden, 2 * inter) with gate and up interleaved column by
column, and down as (E, inter, hidden): converted at load to the engine's (E, 2 * inter, hidden),
gate rows first, and (E, hidden, inter). OpenAI's MXFP4 checkpoints are quantized (issue 31).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine.model_config import ModelConfig, MoeConfig, base_fields, layer_windows
from engine.models import Architecture, llama
from engine.models.checkpoint import State
from engine.models.decoder import CausalLM
from engine.models.moe import mixture_model


def read_config(model_dir: Path, raw: dict[str, Any]) -> ModelConfig:
    fields = base_fields(model_dir, raw)
    windows = layer_windows(raw, fields["num_layers"])
    fields.update(
        attention_bias=True,
        o_proj_bias=True,
        attention_sinks=True,
        sliding_window=next((w for w in windows if w), None),
        layer_windows=windows,
        moe=MoeConfig(
            num_experts=int(raw["num_local_experts"]),
            top_k=int(raw["num_experts_per_tok"]),
            intermediate_size=int(raw["intermediate_size"]),
            routing="topk_softmax",
            renormalize=False,
            router_bias=True,
            expert_bias=True,
            activation="gpt_oss",
            alpha=float(raw.get("swiglu_alpha", 1.702)),
            limit=float(raw.get("swiglu_limit", 7.0)),
        ),
        moe_layers=(True,) * fields["num_layers"],
    )
    return ModelConfig(**fields)


def build(config: ModelConfig) -> CausalLM:
    return mixture_model(config)


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    """(..., 2 * inter) with gate, up alternating -> gate values then up values."""
    return torch.cat([t[..., ::2], t[..., 1::2]], dim=-1)


def convert(state: State, config: ModelConfig) -> None:
    for name in [n for n in state if n.endswith(".mlp.experts.gate_up_proj")]:
        layer = name.removesuffix(".experts.gate_up_proj")
        gate_up = state.pop(name)  # (E, hidden, 2 * inter), interleaved
        state[f"{layer}.gate_up"] = _deinterleave(gate_up).transpose(1, 2).contiguous()
        bias = state.pop(f"{layer}.experts.gate_up_proj_bias")
        state[f"{layer}.gate_up_bias"] = _deinterleave(bias).contiguous()
        state[f"{layer}.down"] = (
            state.pop(f"{layer}.experts.down_proj").transpose(1, 2).contiguous()
        )
        state[f"{layer}.down_bias"] = state.pop(f"{layer}.experts.down_proj_bias")
    llama.convert(state, config)


ARCHITECTURE = Architecture("gpt-oss", ("gpt_oss",), read_config, build, convert)
