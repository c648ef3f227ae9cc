"""builtin:tiny-llava: LLaVA-1.5's layout scaled down for parity tests against transformers: a
CLIP vision tower (3 layers, 56-pixel images in 14-pixel patches: 16 image tokens, features from
the second-to-last layer, CLS dropped), a GELU projector and a 4-layer Llama over the tiny
model's tokenizer, whose `<|image_pad|>` is the image placeholder. Random weights as
tools/tiny_arch/build.py makes them (varied greedy continuations), plus the
preprocessor_config.json of CLIP's image processor at that size (resize, centre crop, CLIP's
mean and std), which the frontend follows.

    orchestrator build-model builtin:tiny-llava
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from common.model_cache import progress
from tools.tiny_arch.build import (
    MAX_SEEDS,
    SEED,
    SMALL,
    _varied,
    init_random,
    save_tiny,
)
from tools.tiny_model.build import ENDOFTEXT_ID, fixed_threads, write_tokenizer_files

IMAGE_TOKEN_ID = 4082  # the tiny tokenizer's <|image_pad|>
IMAGE_SIZE, PATCH_SIZE = 56, 14
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def config() -> object:
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                              num_attention_heads=4, image_size=IMAGE_SIZE,
                              patch_size=PATCH_SIZE, projection_dim=32)  # fmt: skip
    text = LlamaConfig(**SMALL, max_position_embeddings=4096)
    return LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN_ID,
        vision_feature_layer=-2, vision_feature_select_strategy="default",
        projector_hidden_act="gelu", image_seq_length=(IMAGE_SIZE // PATCH_SIZE) ** 2,
        eos_token_id=SMALL["eos_token_id"], pad_token_id=ENDOFTEXT_ID,
        tie_word_embeddings=False,
    )  # fmt: skip


def preprocessor_config() -> dict:
    return {
        "image_processor_type": "CLIPImageProcessor",
        "do_resize": True, "size": {"shortest_edge": IMAGE_SIZE}, "resample": 3,
        "do_center_crop": True, "crop_size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        "do_rescale": True, "rescale_factor": 1 / 255,
        "do_normalize": True, "image_mean": CLIP_MEAN, "image_std": CLIP_STD,
        "do_convert_rgb": True,
    }  # fmt: skip


def build_tiny_llava(path: Path, dtype: str = "float32") -> Path:
    """Write builtin:tiny-llava into `path` (float32 whatever `dtype`: the engine casts it)."""
    from transformers import AutoTokenizer, LlavaForConditionalGeneration

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    write_tokenizer_files(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    llava_config = config()
    eos = [SMALL["eos_token_id"]]
    with fixed_threads(1):
        for attempt in range(MAX_SEEDS):
            torch.manual_seed(SEED + attempt)
            model = LlavaForConditionalGeneration(llava_config).eval()
            init_random(model, torch.Generator().manual_seed(SEED + attempt), gemma=False)
            if _varied(model, tokenizer, eos):
                break
            progress(f"tiny-llava: seed {SEED + attempt} repeats itself; trying the next")
        else:
            raise RuntimeError(f"tiny-llava: no seed of {MAX_SEEDS} gave varied continuations")
    (path / "preprocessor_config.json").write_text(json.dumps(preprocessor_config(), indent=2))
    return save_tiny(model, path, eos, "tiny-llava")
