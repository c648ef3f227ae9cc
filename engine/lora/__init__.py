"""Multi-LoRA: PEFT adapters served beside the base model, any mix of them in one batch
(adapter.py reads one, manager.py holds them in the layers' slots, registry.py is what the
engine asks; the batched matmul is engine/kernels/lora.py)."""

from __future__ import annotations

from torch import nn

from common.config import LoRAConfig
from engine.lora.manager import LoRAManager
from engine.lora.registry import LoRARegistry


def lora_registry(model: nn.Module, config: LoRAConfig | None) -> LoRARegistry | None:
    """The engine's adapters with cluster.yaml's loaded; None when LoRA is off."""
    if config is None:
        return None
    registry = LoRARegistry(LoRAManager(model, config.max_loras, config.max_lora_rank))
    for name, path in config.adapters.items():
        registry.load(name, path)
    return registry
