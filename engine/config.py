"""Engine settings: one frozen record built by the entry point (cluster.yaml or the LLM API)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from common.config import KVOffloadConfig, LoRAConfig, SpeculativeConfig
from common.hub_models import cached_snapshot, parse_hub_id
from engine.models.checkpoint import QUANTIZATIONS

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# the KV cache's: auto = the model's dtype; int8 = 8-bit rows with a scale each (kv_quant.py)
KV_CACHE_DTYPES = {"bfloat16": torch.bfloat16, "int8": torch.int8}


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str  # a local Hugging Face directory, a builtin (builtin:tiny), a hub id (org/name)
    dtype: str = "float32"  # float32 | bfloat16 | float16
    device: str = "cpu"
    block_size: int = 16
    num_blocks: int = 2048
    enable_prefix_caching: bool = True
    max_num_seqs: int = 64  # sequences in one continuous batch
    max_num_batched_tokens: int = (
        2048  # token budget of one step; smaller means smaller prefill chunks
    )
    # a step starts prompt chunks only while it holds fewer tokens (engine/scheduler.py); None:
    # max_num_batched_tokens
    step_fill_tokens: int | None = None
    # None: the model's max_position_embeddings, capped at the cache (common.config.context_length)
    max_model_len: int | None = None
    attention_backend: Literal["auto", "torch", "cpu", "triton"] = "auto"
    kv_cache_dtype: Literal["auto", "bfloat16", "int8"] = "auto"  # as vLLM's --kv-cache-dtype
    # as vLLM's --quantization: auto | gguf | compressed-tensors | gptq | awq | dequantize
    # (engine/models/checkpoint.py QUANTIZATIONS)
    quantization: str = "auto"
    lora: LoRAConfig | None = None  # multi-LoRA (engine/lora/); None: no adapters
    kv_offload: KVOffloadConfig = KVOffloadConfig()  # kv_cache.offload: off unless host_bytes
    # n-gram speculative decoding on decoding sequences (engine/ngram_proposer.py); None: off
    speculative: SpeculativeConfig | None = None
    # decode-only steps replayed as CUDA graphs, one per batch-size bucket, where the device is
    # cuda (engine/cuda_graphs.py); no effect on a CPU
    cuda_graphs: bool = True

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        for name in ("block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.step_fill_tokens is not None and not (
            1 <= self.step_fill_tokens <= self.max_num_batched_tokens
        ):
            raise ValueError(
                "step_fill_tokens must be between 1 and max_num_batched_tokens "
                f"({self.max_num_batched_tokens}), got {self.step_fill_tokens}"
            )
        if self.attention_backend not in ("auto", "torch", "cpu", "triton"):
            raise ValueError("attention_backend must be auto, torch, cpu or triton")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}"
            )
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be auto, bfloat16 or int8, got {self.kv_cache_dtype!r}"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        """The KV pool's dtype: the model's for auto."""
        return KV_CACHE_DTYPES.get(self.kv_cache_dtype, self.torch_dtype)

    def model_dir(self) -> Path:
        """The model directory, building a builtin into its cache on first use; a hub id's
        snapshot comes from the Hugging Face cache only (a worker never downloads)."""
        if self.model.startswith("builtin:"):
            from engine.builtin_build import ensure_builtin

            return ensure_builtin(self.model, self.dtype)
        hub = parse_hub_id(self.model)
        if hub is not None:
            return cached_snapshot(hub)
        path = Path(self.model).expanduser()
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"model {self.model!r}: no config.json in {path}")
        return path
