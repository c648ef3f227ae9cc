"""A checkpoint's config.json as transformers reads it: the language model's part, with the
fields its config class fills in when a checkpoint leaves them out.

transformers builds a config object whose class carries defaults, and checkpoints rely on them:
google/gemma-3-4b-it's `text_config` names only its sizes, rope scaling and window (heads,
head_dim, vocabulary, rotary bases and the 131k context come from Gemma3TextConfig), and a
config saved with `use_diff` drops every field equal to its default. Reading the bare JSON would
fail on such a checkpoint (no `num_attention_heads`) or, worse, run it with other values; the
engine and the frontend both read it through here. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# The defaults of transformers' config classes (5.x, checked against its classes) for the fields
# the engine reads, in 4.x's top-level spelling (rope_theta, rope_scaling), which the engine
# reads beside 5.x's rope_parameters; only where they differ from the engine's own fallbacks.
_GEMMA3_TEXT = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
    "tie_word_embeddings": True,
}
DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma2": {
        "vocab_size": 256_000,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "tie_word_embeddings": True,
    },
    "gemma3": _GEMMA3_TEXT,
    "gemma3_text": _GEMMA3_TEXT,
    "gpt_oss": {
        "num_hidden_layers": 36,
        "head_dim": 64,
        "max_position_embeddings": 131_072,
        "rms_norm_eps": 1e-5,
        "sliding_window": 128,
        "rope_theta": 150_000.0,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },  # fmt: skip
        "swiglu_limit": 7.0,
    },
    "mistral": {"sliding_window": 4096, "max_position_embeddings": 131_072},
    "mixtral": {
        "rms_norm_eps": 1e-5,
        "rope_theta": 1_000_000.0,
        "max_position_embeddings": 131_072,
    },
    "phi3": {"rms_norm_eps": 1e-5, "original_max_position_embeddings": 4096},
    "qwen3_moe": {"max_position_embeddings": 32_768},
}


def language_model_config(raw: dict[str, Any]) -> dict[str, Any]:
    """config.json's language model: a multimodal Gemma 3's `text_config` (as model_type gemma3,
    which the weights' names follow), its class's defaults under what the checkpoint sets."""
    model_type = str(raw.get("model_type", ""))
    if model_type == "gemma3" and "text_config" in raw:
        eos = {"eos_token_id": raw["eos_token_id"]} if "eos_token_id" in raw else {}
        raw = {**eos, **raw["text_config"], "model_type": "gemma3"}
    if model_type == "llava":  # its text model's config, read by that model's module
        text = raw.get("text_config") or {}
        language_model_type = str(text.get("model_type", "llama"))
        raw = {**DEFAULTS.get(language_model_type, {}), **text, "model_type": "llava",
               "language_model_type": language_model_type}  # fmt: skip
    config = {**DEFAULTS.get(model_type, {}), **raw}
    if model_type == "gpt_oss" and not config.get("layer_types"):  # GptOssConfig alternates
        config["layer_types"] = [
            "sliding_attention" if i % 2 == 0 else "full_attention"
            for i in range(int(config["num_hidden_layers"]))
        ]
    return config


@dataclass(frozen=True, slots=True)
class ImageLayout:
    """How a LLaVA-style checkpoint's prompt holds an image (config.json, LlavaConfig's defaults),
    read alike by the frontend, which expands each image's token, and the engine, whose encoder
    makes that many rows."""

    image_token_id: int
    image_size: int
    patch_size: int
    keep_cls: bool  # vision_feature_select_strategy "full" (else "default": CLS dropped)

    @property
    def num_image_tokens(self) -> int:
        return (self.image_size // self.patch_size) ** 2 + (1 if self.keep_cls else 0)


def image_layout(raw: dict[str, Any]) -> ImageLayout | None:
    """None for a checkpoint without a vision tower."""
    vision = raw.get("vision_config")
    if not vision:
        return None
    return ImageLayout(
        image_token_id=int(raw.get("image_token_index", raw.get("image_token_id", 32000))),
        image_size=int(vision.get("image_size", 224)),
        patch_size=int(vision.get("patch_size", 32)),
        keep_cls=raw.get("vision_feature_select_strategy", "default") == "full",
    )
