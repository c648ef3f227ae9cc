"""Qwen3-MoE: Qwen3's attention (per-head q / k norms) with a mixture of experts as the MLP of
every `decoder_sparse_step`-th layer not in `mlp_only_layers`: softmax over the experts, the top
k, renormalised when `norm_topk_prob`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.model_config import ModelConfig, MoeConfig, base_fields
from engine.models import Architecture, llama
from engine.models.checkpoint import State, moe_from_checkpoint
from engine.models.decoder import CausalLM
from engine.models.layers import RMSNorm
from engine.models.moe import mixture_model


def read_config(model_dir: Path, raw: dict[str, Any]) -> ModelConfig:
    fields = base_fields(model_dir, raw)
    num_layers, step = fields["num_layers"], int(raw.get("decoder_sparse_step", 1))
    dense = set(raw.get("mlp_only_layers") or ())
    num_experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
    window = raw.get("sliding_window") if raw.get("use_sliding_window") else None
    fields.update(
        qk_norm=True,
        sliding_window=int(window) if window else None,
        moe=MoeConfig(
            num_experts=num_experts,
            top_k=int(raw["num_experts_per_tok"]),
            intermediate_size=int(raw["moe_intermediate_size"]),
            routing="softmax_topk",
            renormalize=bool(raw.get("norm_topk_prob", False)),
        ),
        moe_layers=tuple(
            num_experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(num_layers)
        ),
    )
    return ModelConfig(**fields)


def build(config: ModelConfig) -> CausalLM:
    return mixture_model(config, qk_norm=RMSNorm)


def convert(state: State, config: ModelConfig) -> None:
    assert config.moe is not None
    moe_from_checkpoint(state, config.moe.num_experts, "gate_proj", "up_proj", "down_proj")
    llama.convert(state, config)


ARCHITECTURE = Architecture("Qwen3-MoE", ("qwen3_moe",), read_config, build, convert)
