"""The shape of a served model, as the engine needs it: one typed record for every architecture.

Each architecture module (engine/models/) reads its own Hugging Face config.json into this record;
what the layers do with it is decided there, not by flags read deep inside shared code. The
readers share the parsing of what is common (sizes, rotary scaling, EOS ids) below. The frontend
reads config.json on its own (torch-free); this module is the engine's view.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from common.hf_config import ImageLayout

RopeKind = Literal["default", "linear", "llama3", "yarn", "longrope"]
ROPE_KINDS: tuple[str, ...] = ("default", "linear", "llama3", "yarn", "longrope")


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary embedding: the base, the scaling kind and its parameters (see models/rope.py)."""

    theta: float
    kind: RopeKind = "default"
    factor: float = 1.0
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None  # yarn / longrope: cos and sin are scaled by it
    # longrope (Phi-3): per-frequency divisors for short and long contexts
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    # how many of a head's dimensions rotate (Phi-4-mini: 0.75 of them); None: all
    rotary_dim: int | None = None


@dataclass(frozen=True, slots=True)
class MoeConfig:
    """A mixture-of-experts MLP: a router picks `top_k` of `num_experts` gated MLPs per token."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    # "softmax_topk": softmax over every expert, then the top k (Qwen3-MoE, Mixtral);
    # "topk_softmax": the top k logits, then a softmax over them (gpt-oss)
    routing: Literal["softmax_topk", "topk_softmax"]
    renormalize: bool  # softmax_topk: the k weights divided by their sum
    router_bias: bool = False
    expert_bias: bool = False  # gpt-oss: biases on gate_up and down
    activation: Literal["silu", "gpt_oss"] = "silu"
    alpha: float = 1.702  # gpt_oss: gate * sigmoid(alpha * gate)
    limit: float = 7.0  # gpt_oss: the clamp of gate and up

    def __post_init__(self) -> None:  # the C router would read past its row otherwise
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.top_k} is not in [1, {self.num_experts}]")


@dataclass(frozen=True, slots=True)
class VisionConfig:
    """A LLaVA-style model's image path: a CLIP vision encoder, whose hidden states at
    `feature_layer` (CLS dropped for "default") a two-layer projector maps into the language
    model's embeddings, replacing each image's `num_image_tokens` placeholder tokens."""

    language_model_type: str  # the text model's model_type (llama, qwen2, mistral)
    layout: ImageLayout  # the placeholder token, the image's size and patches, CLS kept or not
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_channels: int
    layer_norm_eps: float
    hidden_act: Literal["quick_gelu", "gelu"]
    feature_layer: int  # a hidden state of the encoder: -1 its last layer's output, -2 ...
    projector_act: Literal["gelu", "quick_gelu"]
    projector_bias: bool

    @property
    def image_token_id(self) -> int:  # one per image feature row in the prompt
        return self.layout.image_token_id

    @property
    def num_image_tokens(self) -> int:
        return self.layout.num_image_tokens

    @property
    def image_size(self) -> int:
        return self.layout.image_size

    @property
    def layers_run(self) -> int:
        """Encoder layers that the feature layer needs (hidden state i is after i layers)."""
        return self.feature_layer % (self.num_layers + 1)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # of a dense MLP
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # Qwen2, gpt-oss: q/k/v biases
    qk_norm: bool  # Qwen3, Gemma 3: q and k normalised per head
    sliding_window: int | None  # the window of the layers that have one
    eos_token_ids: tuple[int, ...]
    torch_dtype: str
    # Per layer: its sliding window (None: full attention). Empty means every layer has
    # `sliding_window`.
    layer_windows: tuple[int | None, ...] = ()
    local_rope: RopeConfig | None = None  # Gemma 3: the sliding layers' own rotary base
    o_proj_bias: bool = False  # gpt-oss
    attention_sinks: bool = False  # gpt-oss: a learned logit per head in every softmax
    attention_scale: float | None = None  # None: head_dim ** -0.5
    attn_soft_cap: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    final_soft_cap: float | None = None  # Gemma 2: the same on the logits
    hidden_activation: Literal["silu", "gelu_tanh"] = "silu"
    moe: MoeConfig | None = None
    moe_layers: tuple[bool, ...] = ()  # per layer: its MLP is the mixture (empty: none is)
    vision: VisionConfig | None = None  # a LLaVA-style model's image encoder (models/llava.py)

    def window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else self.sliding_window

    def is_moe(self, layer: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[layer]

    @property
    def scale(self) -> float:
        return self.attention_scale if self.attention_scale is not None else self.head_dim**-0.5


def read_config_json(model_dir: Path) -> dict[str, Any]:
    return dict(json.loads((model_dir / "config.json").read_text()))


def base_fields(model_dir: Path, raw: dict[str, Any]) -> dict[str, Any]:
    """The fields every decoder's config.json spells the same way."""
    num_heads = raw["num_attention_heads"]
    return {
        "model_type": raw.get("model_type", ""),
        "vocab_size": raw["vocab_size"],
        "hidden_size": raw["hidden_size"],
        "intermediate_size": raw["intermediate_size"],
        "num_layers": raw["num_hidden_layers"],
        "num_heads": num_heads,
        "num_kv_heads": raw.get("num_key_value_heads") or num_heads,
        "head_dim": raw.get("head_dim") or raw["hidden_size"] // num_heads,
        "rms_norm_eps": raw.get("rms_norm_eps", 1e-6),
        "rope": rope_config(raw),
        "max_position_embeddings": raw.get("max_position_embeddings", 4096),
        "tie_word_embeddings": raw.get("tie_word_embeddings", False),
        "attention_bias": bool(raw.get("attention_bias", False)),
        "qk_norm": False,
        "sliding_window": None,
        "eos_token_ids": eos_token_ids(model_dir, raw),
        "torch_dtype": str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
    }


def rope_parameters(raw: dict[str, Any], layer_type: str | None = None) -> dict[str, Any]:
    """transformers 5 nests theta and scaling in `rope_parameters` (per layer type for Gemma 3);
    4.x had rope_theta and rope_scaling at the top."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if layer_type is not None and layer_type in params:
        params = params[layer_type]
    return dict(params)


def rope_config(
    raw: dict[str, Any], layer_type: str | None = None, default_theta: float = 10000.0
) -> RopeConfig:
    params = rope_parameters(raw, layer_type)
    theta = float(params.get("rope_theta", raw.get("rope_theta", default_theta)))
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind == "su":  # Phi-3's first checkpoints named longrope so
        kind = "longrope"
    if kind not in ROPE_KINDS:
        raise ValueError(f"rope type {kind!r} is not supported ({', '.join(ROPE_KINDS)})")
    head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    partial = float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    original = params.get("original_max_position_embeddings")
    if kind == "longrope" or original is None:  # as transformers: Phi-3's top-level field first
        original = raw.get("original_max_position_embeddings") or original
    if original is None and kind == "yarn":  # transformers: else the model's own length
        original = raw.get("max_position_embeddings")
    factor = params.get("factor")
    if factor is None and kind in ("yarn", "longrope") and original:
        # as transformers: the ratio of the served length to the pretraining length
        factor = raw.get("max_position_embeddings", original) / original
    return RopeConfig(
        theta=theta,
        kind=kind,
        factor=float(factor or 1.0),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(original or 8192),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"),
        short_factor=tuple(float(f) for f in params.get("short_factor") or ()),
        long_factor=tuple(float(f) for f in params.get("long_factor") or ()),
        rotary_dim=int(head_dim * partial) if partial != 1.0 else None,
    )


def layer_windows(raw: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """Per layer, its sliding window: from `layer_types` (transformers 5: "sliding_attention" /
    "full_attention"), else none."""
    window = raw.get("sliding_window")
    types = raw.get("layer_types")
    if not window or not types:
        return ()
    if len(types) != num_layers:
        raise ValueError(f"layer_types has {len(types)} entries for {num_layers} layers")
    return tuple(int(window) if t == "sliding_attention" else None for t in types)


def eos_token_ids(model_dir: Path, raw: dict[str, Any]) -> tuple[int, ...]:
    """EOS ids from generation_config.json (what `generate` stops on), else from config.json."""
    eos = raw.get("eos_token_id")
    gen_path = model_dir / "generation_config.json"
    if gen_path.exists():
        eos = json.loads(gen_path.read_text()).get("eos_token_id", eos)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)
