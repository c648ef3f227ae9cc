"""Qwen2 / Qwen2.5 (q, k, v biases) and Qwen3 (per-head RMSNorm on q and k): Llama's layer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.model_config import ModelConfig, base_fields, layer_windows
from engine.models import Architecture, llama
from engine.models.decoder import CausalLM, pre_norm_model
from engine.models.layers import RMSNorm


def read_config(model_dir: Path, raw: dict[str, Any]) -> ModelConfig:
    fields = base_fields(model_dir, raw)
    qwen2 = raw.get("model_type") == "qwen2"
    windows = layer_windows(raw, fields["num_layers"])
    if not windows and raw.get("use_sliding_window") and raw.get("sliding_window"):
        # transformers 4.x: the layers from max_window_layers on slide
        first = int(raw.get("max_window_layers", 0))
        window = int(raw["sliding_window"])
        windows = tuple(window if i >= first else None for i in range(fields["num_layers"]))
    fields.update(
        attention_bias=bool(raw.get("attention_bias", qwen2)),
        qk_norm=not qwen2,
        sliding_window=next((w for w in windows if w), None),
        layer_windows=windows,
    )
    return ModelConfig(**fields)


def build(config: ModelConfig) -> CausalLM:
    return pre_norm_model(config, qk_norm=RMSNorm if config.qk_norm else None)


ARCHITECTURE = Architecture("Qwen2 / Qwen3", ("qwen2", "qwen3"), read_config, build, llama.convert)
