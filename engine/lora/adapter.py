"""A LoRA adapter read from a PEFT directory (`adapter_config.json` + `adapter_model.safetensors`),
its matrices renamed onto the engine's fused projections.

PEFT stores, per targeted module, A (r, in_features) and B (out_features, r); the module's output
gains scale * B @ A @ x with scale = lora_alpha / r (lora_alpha / sqrt(r) under rslora). The
engine fuses q, k, v into `qkv_proj` and gate, up into `gate_up_proj` (models/llama.py convert),
so each checkpoint module becomes one slice of a fused layer's output:

    q_proj -> qkv_proj slice 0     k_proj -> slice 1     v_proj -> slice 2
    gate_proj -> gate_up_proj slice 0                    up_proj -> slice 1
    o_proj -> o_proj               down_proj -> down_proj

What PEFT can express but the engine does not serve (DoRA, trained embeddings or LM head,
modules_to_save, per-module ranks, a LoRA bias) is refused with one clear line at load.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

# checkpoint module -> (engine layer, slice index within its fused output)
TARGETS = {
    "q_proj": ("self_attn.qkv_proj", 0),
    "k_proj": ("self_attn.qkv_proj", 1),
    "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0),
    "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", 0),
}
_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass(slots=True)
class LoRAAdapter:
    name: str
    path: str
    rank: int
    scale: float  # lora_alpha / rank (or / sqrt(rank) under rslora)
    # (engine layer, e.g. "model.layers.3.self_attn.qkv_proj", slice) -> (A (r, in), B (out, r))
    weights: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def read_adapter(name: str, path: str | Path, max_rank: int) -> LoRAAdapter:
    """The adapter at `path` as float32 tensors; ValueError for anything the engine cannot serve."""
    directory = Path(path).expanduser()
    config_file = directory / "adapter_config.json"
    if not config_file.exists():
        raise ValueError(f"LoRA adapter {name!r}: no adapter_config.json in {directory}")
    config = json.loads(config_file.read_text())
    _check_config(name, config)
    rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    if not 1 <= rank <= max_rank:
        raise ValueError(f"LoRA adapter {name!r}: rank {rank} is over max_lora_rank {max_rank}")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    adapter = LoRAAdapter(name, str(directory), rank, scale)
    pairs: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
    for key, tensor in _tensors(name, directory).items():
        match = _KEY.match(key)
        module = match.group(2) if match else None
        if match is None or module not in TARGETS:
            raise ValueError(f"LoRA adapter {name!r}: tensor {key} is not a LoRA matrix of "
                             f"{', '.join(TARGETS)}")  # fmt: skip
        layer, part = TARGETS[module]
        slot = (f"model.layers.{match.group(1)}.{layer}", part)
        pairs.setdefault(slot, {})[match.group(3)] = tensor.float()
    for slot, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {name!r}: {slot[0]} has lora_A or lora_B alone")
        a, b = pair["A"], pair["B"]
        if a.shape[0] != rank or b.shape[1] != rank:
            raise ValueError(f"LoRA adapter {name!r}: {slot[0]} is not of rank {rank}")
        adapter.weights[slot] = (a, b)
    if not adapter.weights:
        raise ValueError(f"LoRA adapter {name!r}: {directory} holds no LoRA matrices")
    return adapter


def _check_config(name: str, config: dict) -> None:
    refusals = {
        "use_dora": "DoRA",
        "modules_to_save": "modules_to_save (trained full modules)",
        "rank_pattern": "per-module ranks (rank_pattern)",
        "alpha_pattern": "per-module alphas (alpha_pattern)",
        "layers_to_transform": "layers_to_transform",
    }
    for key, what in refusals.items():
        if config.get(key):
            raise ValueError(f"LoRA adapter {name!r}: {what} is not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {name!r}: LoRA biases are not supported")
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {name!r}: peft_type {config['peft_type']} is not LORA")
    if "r" not in config:
        raise ValueError(f"LoRA adapter {name!r}: adapter_config.json has no rank r")


def _tensors(name: str, directory: Path) -> dict[str, torch.Tensor]:
    file = directory / "adapter_model.safetensors"
    if file.exists():
        return load_file(str(file))
    legacy = directory / "adapter_model.bin"
    if legacy.exists():
        return torch.load(legacy, map_location="cpu", weights_only=True)
    raise ValueError(f"LoRA adapter {name!r}: no adapter_model.safetensors in {directory}")
