"""Mixtral: Mistral's attention with a mixture of experts as every layer's MLP (softmax over the
experts, the top k, renormalised); its checkpoints name the MoE `block_sparse_moe` and an
expert's projections w1 (gate), w3 (up), w2 (down)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.model_config import ModelConfig, MoeConfig, base_fields
from engine.models import Architecture, llama
from engine.models.checkpoint import State, moe_from_checkpoint, rename
from engine.models.decoder import CausalLM
from engine.models.moe import mixture_model


def read_config(model_dir: Path, raw: dict[str, Any]) -> ModelConfig:
    fields = base_fields(model_dir, raw)
    window = raw.get("sliding_window")
    fields.update(
        sliding_window=int(window) if window else None,
        moe=MoeConfig(
            num_experts=int(raw["num_local_experts"]),
            top_k=int(raw["num_experts_per_tok"]),
            intermediate_size=int(raw["intermediate_size"]),
            routing="softmax_topk",
            renormalize=True,
        ),
        moe_layers=(True,) * fields["num_layers"],
    )
    return ModelConfig(**fields)


def build(config: ModelConfig) -> CausalLM:
    return mixture_model(config)


def convert(state: State, config: ModelConfig) -> None:
    assert config.moe is not None
    rename(state, r"\.block_sparse_moe\.", ".mlp.")
    moe_from_checkpoint(state, config.moe.num_experts, "w1", "w3", "w2")
    llama.convert(state, config)


ARCHITECTURE = Architecture("Mixtral", ("mixtral",), read_config, build, convert)
