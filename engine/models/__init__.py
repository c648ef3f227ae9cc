"""The architectures the engine serves, one module each over the shared layers (layers.py,
decoder.py, moe.py), looked up by config.json's model_type as vLLM's model registry does.

Each module exports ARCHITECTURE: how to read its config.json into a ModelConfig, how to build
the module tree, and how its checkpoint's tensor names map onto it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from common.hf_config import language_model_config
from engine.linear import Linear
from engine.model_config import ModelConfig, read_config_json
from engine.models.checkpoint import State, read_checkpoint
from engine.models.decoder import CausalLM
from engine.quant.weight import QuantizedWeight


@dataclass(frozen=True, slots=True)
class Architecture:
    name: str  # as README's table names it
    model_types: tuple[str, ...]  # config.json values it serves
    read_config: Callable[[Path, dict], ModelConfig]
    build: Callable[[ModelConfig], CausalLM]
    convert: Callable[[State, ModelConfig], None]  # checkpoint names -> the module's, in place


def _registry() -> dict[str, Architecture]:
    from engine.models import gemma, gpt_oss, llama, llava, mixtral, phi3, qwen, qwen3_moe

    modules = (llama, qwen, phi3, gemma, qwen3_moe, mixtral, gpt_oss, llava)
    return {t: m.ARCHITECTURE for m in modules for t in m.ARCHITECTURE.model_types}


def supported_model_types() -> list[str]:
    return sorted(_registry())


def architecture(model_type: str, where: str = "") -> Architecture:
    registry = _registry()
    if model_type not in registry:
        names = ", ".join(sorted(registry))
        raise ValueError(f"{where}model_type {model_type!r} is not supported (supported: {names})")
    return registry[model_type]


def read_model_config(model_dir: Path) -> ModelConfig:
    """config.json read by its architecture's module; one clear line for anything unsupported."""
    raw = read_config_json(model_dir)
    arch = architecture(str(raw.get("model_type", "")), f"{model_dir}: ")
    if raw.get("quantization_config"):  # read by engine/formats/hf_quant.py, or refused here
        from engine.formats.hf_quant import check_supported

        check_supported(raw["quantization_config"], f"{model_dir}: ")
    return arch.read_config(model_dir, language_model_config(raw))


def load_model(
    model_dir: Path,
    config: ModelConfig,
    dtype: torch.dtype,
    max_positions: int | None = None,
    quantization: str = "auto",
) -> CausalLM:
    """Build the module on the meta device and assign the checkpoint's tensors: no double memory.
    Rotary tables are made for `max_positions` (default: the model's maximum); `quantization`:
    checkpoint.QUANTIZATIONS."""
    arch = architecture(config.model_type)
    with torch.device("meta"):
        model = arch.build(config)
    state = read_checkpoint(model_dir, dtype, quantization)
    arch.convert(state, config)
    if config.tie_word_embeddings or "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    _assign_quantized(model, state, dtype)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise ValueError(
            f"{model_dir}: checkpoint mismatch, missing={missing} unexpected={unexpected}"
        )
    model.attach_rotary(max_positions or config.max_position_embeddings)
    return model.eval()


def _assign_quantized(model: CausalLM, state: State, dtype: torch.dtype) -> None:
    """Hand each quantized matrix to its linear layer (which keeps it quantized: engine/linear.py)
    and out of `state`; an embedding table is looked up by row, not streamed, so it is
    dequantized to the model's dtype (its tied LM head stays quantized)."""
    for name in [n for n in state if isinstance(state[n], QuantizedWeight)]:
        weight = state.pop(name)
        assert isinstance(weight, QuantizedWeight)
        module = model.get_submodule(name.removesuffix(".weight"))
        if isinstance(module, Linear) and name.endswith(".weight"):
            module.quantize(weight, dtype)
        elif isinstance(module, torch.nn.Embedding):
            state[name] = weight.dequantize().to(dtype)
        else:
            raise ValueError(f"{name}: a quantized tensor where the model has no linear layer")
