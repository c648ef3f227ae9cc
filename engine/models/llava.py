"""LLaVA (LlavaForConditionalGeneration): a language model of another architecture (Llama,
Qwen2, Mistral) whose prompt holds images: each image's placeholder tokens take the rows of a
CLIP encoder and projector (models/vision.py) instead of their embeddings.

The language model is built, read and converted by its own module, looked up by text_config's
model_type; this one adds the image encoder beside it (`CausalLM.image_encoder`) and maps the
checkpoint's names (transformers 5: `model.language_model.*`, `model.vision_tower.*`,
`model.multi_modal_projector.*`; 4.x: `language_model.model.*`, `vision_tower.vision_model.*`).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

from common.hf_config import image_layout
from engine.model_config import ModelConfig, VisionConfig, read_config_json
from engine.models import Architecture, architecture
from engine.models.checkpoint import State, rename
from engine.models.decoder import CausalLM
from engine.models.vision import ImageEncoder

ACTIVATIONS = ("quick_gelu", "gelu")


def read_config(model_dir: Path, raw: dict[str, Any]) -> ModelConfig:
    """`raw`: the language model's config (common/hf_config.py language_model_config)."""
    full = read_config_json(model_dir)
    language_model_type = str(raw["language_model_type"])
    text = architecture(language_model_type, f"{model_dir}: text_config's ")
    config = text.read_config(model_dir, {**raw, "model_type": language_model_type})
    vision = _vision_config(model_dir, full, language_model_type)
    return dataclasses.replace(config, model_type="llava", vision=vision)


def _vision_config(model_dir: Path, full: dict[str, Any], language_model_type: str) -> VisionConfig:
    raw, layout = full.get("vision_config"), image_layout(full)
    if not raw or layout is None:
        raise ValueError(f"{model_dir}: a llava config.json without its vision_config")
    if raw.get("model_type", "clip_vision_model") != "clip_vision_model":
        raise ValueError(f"{model_dir}: a {raw['model_type']} vision tower is not supported "
                         "(CLIP's is)")  # fmt: skip
    feature_layer = full.get("vision_feature_layer", -2)
    strategy = full.get("vision_feature_select_strategy", "default")
    act = raw.get("hidden_act", "quick_gelu")
    projector_act = full.get("projector_hidden_act", "gelu")
    if not isinstance(feature_layer, int) or strategy not in ("default", "full"):
        raise ValueError(f"{model_dir}: vision_feature_layer {feature_layer!r} / select strategy "
                         f"{strategy!r}: one layer and default or full are supported")  # fmt: skip
    if act not in ACTIVATIONS or projector_act not in ACTIVATIONS:
        raise ValueError(f"{model_dir}: activations {act} / {projector_act} are not supported")
    return VisionConfig(
        language_model_type=language_model_type,
        layout=layout,
        hidden_size=int(raw.get("hidden_size", 768)),
        intermediate_size=int(raw.get("intermediate_size", 3072)),
        num_layers=int(raw.get("num_hidden_layers", 12)),
        num_heads=int(raw.get("num_attention_heads", 12)),
        num_channels=int(raw.get("num_channels", 3)),
        layer_norm_eps=float(raw.get("layer_norm_eps", 1e-5)),
        hidden_act=act,
        feature_layer=feature_layer,
        projector_act=projector_act,
        projector_bias=bool(full.get("multimodal_projector_bias", True)),
    )


def _text_config(config: ModelConfig) -> ModelConfig:
    assert config.vision is not None
    return dataclasses.replace(config, model_type=config.vision.language_model_type, vision=None)


def build(config: ModelConfig) -> CausalLM:
    text = _text_config(config)
    model = architecture(text.model_type).build(text)
    assert config.vision is not None
    model.image_encoder = ImageEncoder(config.vision, config.hidden_size)
    return model


def convert(state: State, config: ModelConfig) -> None:
    assert config.vision is not None
    rename(state, r"^model\.language_model\.", "model.")
    rename(state, r"^language_model\.model\.", "model.")
    rename(state, r"^language_model\.lm_head\.", "lm_head.")
    rename(state, r"^(model\.)?vision_tower\.(vision_model\.)?", "image_encoder.tower.")
    rename(state, r"^(model\.)?multi_modal_projector\.", "image_encoder.projector.")
    rename(state, r"^image_encoder\.tower\.encoder\.layers\.", "image_encoder.tower.layers.")
    layer = re.compile(r"^image_encoder\.tower\.layers\.(\d+)\.")
    for name in list(state):  # past the feature layer, and the post-norm: never used
        found = layer.match(name)
        if name.startswith("image_encoder.tower.post_layernorm.") or (
            found and int(found.group(1)) >= config.vision.layers_run
        ):
            del state[name]
    image = {name: state.pop(name) for name in list(state) if name.startswith("image_encoder.")}
    text = _text_config(config)
    architecture(text.model_type).convert(state, text)
    state.update(image)


ARCHITECTURE = Architecture("LLaVA (CLIP vision)", ("llava",), read_config, build, convert)
