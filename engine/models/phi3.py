"""Phi-3 / Phi-3.5 / Phi-4-mini: Llama's layer with the projections fused in the checkpoint
itself (qkv_proj, gate_up_proj: the engine's own names, so nothing is converted), LongRoPE
scaling (models/rope.py), a partial rotary dimension (Phi-4-mini), and an optional sliding window
on every layer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.model_config import ModelConfig, base_fields
from engine.models import Architecture
from engine.models.checkpoint import State
from engine.models.decoder import CausalLM, pre_norm_model


def read_config(model_dir: Path, raw: dict[str, Any]) -> ModelConfig:
    fields = base_fields(model_dir, raw)
    window = raw.get("sliding_window")
    fields.update(sliding_window=int(window) if window else None)
    return ModelConfig(**fields)


def build(config: ModelConfig) -> CausalLM:
    return pre_norm_model(config)


def convert(state: State, config: ModelConfig) -> None:
    """Nothing: Phi-3 checkpoints already hold qkv_proj and gate_up_proj."""


ARCHITECTURE = Architecture("Phi-3", ("phi3",), read_config, build, convert)
