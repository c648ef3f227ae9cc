"""The parts of a Hugging Face config.json that the engine needs, read without transformers.

Workers load models from a local directory; reading the JSON ourselves keeps the supported set
explicit (Llama, Qwen2, Qwen3 decoders) and rejects anything else with a message instead of wrong
numbers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SUPPORTED_MODEL_TYPES = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float
    kind: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # Qwen2 has q/k/v biases
    qk_norm: bool  # Qwen3 normalises q and k per head
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelConfig:
        raw = json.loads((model_dir / "config.json").read_text())
        model_type = raw.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            supported = ", ".join(sorted(SUPPORTED_MODEL_TYPES))
            raise ValueError(
                f"{model_dir}: model_type {model_type!r} is not supported ({supported})"
            )
        num_heads = raw["num_attention_heads"]
        head_dim = raw.get("head_dim") or raw["hidden_size"] // num_heads
        use_window = raw.get("use_sliding_window", False) and raw.get("sliding_window")
        return cls(
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope=_rope_config(raw),
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            attention_bias=raw.get("attention_bias", model_type == "qwen2"),
            qk_norm=model_type == "qwen3",
            sliding_window=int(raw["sliding_window"]) if use_window else None,
            eos_token_ids=_eos_token_ids(model_dir, raw),
            torch_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
        )


def _rope_config(raw: dict) -> RopeConfig:
    # transformers 5 nests theta and scaling in `rope_parameters`; 4.x had rope_theta, rope_scaling.
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind not in ("default", "linear", "llama3"):
        raise ValueError(f"rope type {kind!r} is not supported (default, linear, llama3)")
    return RopeConfig(
        theta=theta,
        kind=kind,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


def _eos_token_ids(model_dir: Path, raw: dict) -> tuple[int, ...]:
    """EOS ids from generation_config.json (what `generate` stops on), else from config.json."""
    eos = raw.get("eos_token_id")
    gen_path = model_dir / "generation_config.json"
    if gen_path.exists():
        eos = json.loads(gen_path.read_text()).get("eos_token_id", eos)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)
