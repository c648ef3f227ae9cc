"""Random PEFT LoRA adapters for the tests: written by peft itself (the reference the engine is
checked against), with B non-zero so that every adapter changes the output."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(
    model_dir: Path,
    out_dir: Path,
    seed: int,
    rank: int = 8,
    alpha: int = 16,
    targets: tuple[str, ...] = ALL_TARGETS,
    rslora: bool = False,
    magnitude: float = 0.05,
) -> Path:
    """A PEFT directory (adapter_config.json + adapter_model.safetensors) of random A and B."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets),
                        use_rslora=rslora, init_lora_weights=False)  # fmt: skip
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * magnitude)
    peft_model.save_pretrained(out_dir)
    return out_dir


def peft_model(model_dir: Path, adapter_dir: Path) -> torch.nn.Module:
    """The base model with the adapter, as transformers + peft run it."""
    from peft import PeftModel

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
    return PeftModel.from_pretrained(model, adapter_dir).eval()
