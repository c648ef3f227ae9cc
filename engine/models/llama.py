"""Llama (1-3.x, SmolLM) and Mistral: the plain pre-norm decoder. Mistral's sliding window, when
its config sets one, applies to every layer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.model_config import ModelConfig, base_fields, layer_windows
from engine.models import Architecture
from engine.models.checkpoint import State, stack
from engine.models.decoder import CausalLM, pre_norm_model


def read_config(model_dir: Path, raw: dict[str, Any]) -> ModelConfig:
    fields = base_fields(model_dir, raw)
    if raw.get("mlp_bias"):
        raise ValueError(f"{model_dir}: Llama with mlp_bias is not supported")
    window = raw.get("sliding_window") if raw.get("model_type") == "mistral" else None
    fields.update(
        o_proj_bias=fields["attention_bias"] and raw.get("model_type") == "llama",  # as HF's
        sliding_window=int(window) if window else None,
        layer_windows=layer_windows(raw, fields["num_layers"]),
    )
    return ModelConfig(**fields)


def build(config: ModelConfig) -> CausalLM:
    return pre_norm_model(config)


def convert(state: State, config: ModelConfig) -> None:
    """q, k, v and gate, up: stacked for the fused projections."""
    stack(state, ("q_proj", "k_proj", "v_proj"), "qkv_proj")
    stack(state, ("gate_proj", "up_proj"), "gate_up_proj")


ARCHITECTURE = Architecture("Llama / Mistral", ("llama", "mistral"), read_config, build, convert)
