"""Images in a prompt, for a model with an image encoder (LLaVA-style: models/llava.py): each
image's pixels are encoded once, when its request is added, into the rows that replace its
placeholder tokens' embeddings in the prefill.

    prompt   ... t t <img> <img> <img> <img> t t <img> <img> <img> <img> t ...
                     └── image 0: rows 0..3 ──┘     └── image 1: rows 0..3 ──┘

The prompt carries each image as a run of `num_image_tokens` placeholder tokens (the frontend
expands one per image), in the images' order. A sequence keeps its images' rows while it lives:
a preempted prompt is recomputed with them. Each image also salts the prefix cache's hashes with
its digest (`image_key`), so two prompts of equal tokens and different images never share a
cached block; a request carrying its digest already (the frontend's, for the router) is not
salted twice.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from common.block_hash import ExtraKey
from common.errors import InvalidRequest
from common.protocol import PromptImage
from common.protocol.to_engine import IMAGE_KEY
from engine.model_config import VisionConfig
from engine.models.decoder import CausalLM

ImageRows = list[tuple[int, torch.Tensor]]  # (the run's first prompt index, (tokens, hidden))


def image_key(pixels: torch.Tensor) -> tuple[str, str]:
    """The prefix-cache key of one image: a digest of its float32 pixel values."""
    data = pixels.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()
    return (IMAGE_KEY, hashlib.sha256(data).hexdigest())


def placeholder_runs(prompt: Sequence[int], vision: VisionConfig) -> list[int]:
    """The first index of each image's run of placeholders; InvalidRequest when a run is cut
    short or overlong (the frontend expands each image to exactly num_image_tokens)."""
    size, token = vision.num_image_tokens, vision.image_token_id
    starts, i = [], 0
    while i < len(prompt):
        if prompt[i] != token:
            i += 1
            continue
        end = i
        while end < len(prompt) and prompt[end] == token:
            end += 1
        if (end - i) % size:
            raise InvalidRequest(f"a run of {end - i} image placeholder tokens at {i}: each image "
                                 f"takes {size}", "prompt")  # fmt: skip
        starts.extend(range(i, end, size))
        i = end
    return starts


def encode_images(
    model: CausalLM,
    vision: VisionConfig | None,
    prompt: Sequence[int],
    images: Sequence[torch.Tensor],
) -> ImageRows:
    """Each image's rows at its run of placeholders; InvalidRequest when the model takes no
    images, or the prompt's runs and the images do not pair up."""
    if vision is None:
        if images:
            raise InvalidRequest("this model takes text only: it has no image encoder", "images")
        return []
    starts = placeholder_runs(prompt, vision)
    if len(starts) != len(images):
        raise InvalidRequest(f"the prompt has {len(starts)} image placeholder runs and "
                             f"{len(images)} images came with it", "images")  # fmt: skip
    if not images:
        return []
    assert model.image_encoder is not None
    device = model.model.embed_tokens.weight.device
    try:
        rows = model.image_encoder(torch.stack([p.to(device) for p in images]))
    except (ValueError, RuntimeError) as e:  # a wrong shape, from a client of the engine
        raise InvalidRequest(str(e), "images") from None
    return list(zip(starts, rows, strict=True))


def salted(
    extra_keys: tuple[ExtraKey, ...], images: Sequence[torch.Tensor]
) -> tuple[ExtraKey, ...]:
    """The request's keys and each image's. A request from the frontend carries its images'
    digests already (the ones the router hashed with): they are not computed again here."""
    carried = sum(1 for k in extra_keys if isinstance(k, tuple) and k[:1] == (IMAGE_KEY,))
    if carried == len(images):
        return extra_keys
    return (*extra_keys, *(image_key(p) for p in images))


def pixels_of(images: Sequence[PromptImage], vision: VisionConfig | None) -> list[torch.Tensor]:
    """The wire's images (common/protocol PromptImage) as the encoder's pixel tensors;
    InvalidRequest when their size is not this model's, or the model takes no images."""
    if not images:
        return []
    if vision is None:
        raise InvalidRequest("this model takes text only: it has no image encoder", "images")
    shape = (vision.num_channels, vision.image_size, vision.image_size)
    expected = 4 * shape[0] * shape[1] * shape[2]
    out = []
    for image in images:
        if len(image.pixels) != expected:
            raise InvalidRequest(f"an image of {len(image.pixels)} bytes: this model's images "
                                 f"are {expected} (float32 {shape})", "images")  # fmt: skip
        out.append(torch.frombuffer(bytearray(image.pixels), dtype=torch.float32).view(shape))
    return out
