"""Images in a prompt, on the frontend's side: fetched, decoded and turned into the model's pixel
values while the template renders, then sent with the prompt (common/protocol PromptImage) to
the worker that prefills it (engine/prompt_images.py encodes them there).

    image_url / Anthropic image / Responses input_image
        ─ fetch (an http(s) URL, with a size cap and a timeout, awaited on the loop while the
          render runs in its thread; a data: URL is base64-decoded in a thread)
        ─ decode and preprocess in a thread (Pillow; CLIP's image processor, as the model's
          preprocessor_config.json says: resize the short edge, centre crop, rescale, normalise)
        ─ PromptImage(float32 pixels, their sha256)

In the rendered prompt each image is the model's image token, once; `expand_placeholders`
repeats it to the number of rows the encoder makes for an image. Whatever fails (an unreachable
URL, too many bytes, not an image) is the client's 400, naming the image.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import io
import json
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgspec
import numpy as np

from common.errors import InvalidRequest
from common.hf_config import image_layout
from common.protocol import GenerateRequest, PromptImage

MAX_IMAGE_BYTES = 20 * 1024 * 1024  # an image's encoded size, fetched or inline
FETCH_TIMEOUT_S = 10.0
MAX_IMAGES = 16  # per request
MAX_PIXELS = 40_000_000  # an image's, decoded (8k x 5k): 120 MB as RGB
MAX_ASPECT = 64  # long side / short side: a 1 x 64 strip resized to 336 is 21,504 wide
BICUBIC = 3  # PIL's resample code, CLIP's default


@dataclass(frozen=True, slots=True)
class VisionInfo:
    """What the frontend needs of a vision-language model: its image layout (config.json, read
    as the engine reads it: common/hf_config.py) and its image processor's settings
    (preprocessor_config.json)."""

    image_token: str  # as the template writes it, once per image
    image_token_id: int
    num_image_tokens: int  # per image, after expansion
    size: int  # the short edge after resizing
    crop: int  # the square the encoder takes
    resample: int
    rescale_factor: float
    mean: tuple[float, ...]
    std: tuple[float, ...]

    @classmethod
    def of_model(
        cls, model_dir: Path, hf_config: dict[str, Any], tokenizer: Any
    ) -> VisionInfo | None:
        """None for a text-only model (no vision_config)."""
        layout = image_layout(hf_config)
        if layout is None:
            return None
        token_id, image_size = layout.image_token_id, layout.image_size
        processor_file = model_dir / "preprocessor_config.json"
        processor = json.loads(processor_file.read_text()) if processor_file.exists() else {}
        size = processor.get("size", {}).get("shortest_edge", image_size)
        crop = processor.get("crop_size", {}).get("height", image_size)
        if crop != image_size:
            raise ValueError(f"{model_dir}: images cropped to {crop} for an encoder of "
                             f"{image_size}")  # fmt: skip
        return cls(
            image_token=tokenizer.id_to_token(token_id) or "",
            image_token_id=token_id,
            num_image_tokens=layout.num_image_tokens,
            size=int(size),
            crop=int(crop),
            resample=int(processor.get("resample", BICUBIC)),
            rescale_factor=float(processor.get("rescale_factor", 1 / 255)),
            mean=tuple(processor.get("image_mean", (0.48145466, 0.4578275, 0.40821073))),
            std=tuple(processor.get("image_std", (0.26862954, 0.26130258, 0.27577711))),
        )


def preprocess(data: bytes, vision: VisionInfo) -> np.ndarray:
    """Encoded image bytes -> (3, crop, crop) float32, as CLIP's image processor makes them;
    ValueError when the bytes are no image Pillow reads."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as opened:
            width, height = opened.size  # from the header: nothing decoded yet
            check_size(width, height)
            image = opened.convert("RGB")
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as e:
        raise ValueError(f"not an image Pillow can read ({e})") from None
    short, long = min(width, height), max(width, height)
    new_long = int(vision.size * long / short)
    new_size = (vision.size, new_long) if width <= height else (new_long, vision.size)
    image = image.resize(new_size, resample=vision.resample)  # (width, height)
    pixels = np.asarray(image).transpose(2, 0, 1)  # (3, height, width) uint8
    top = (pixels.shape[1] - vision.crop) // 2
    left = (pixels.shape[2] - vision.crop) // 2
    pixels = pixels[:, top : top + vision.crop, left : left + vision.crop]
    scaled = (pixels.astype(np.float64) * vision.rescale_factor).astype(np.float32)
    mean = np.asarray(vision.mean, dtype=np.float32)[:, None, None]
    std = np.asarray(vision.std, dtype=np.float32)[:, None, None]
    return np.ascontiguousarray((scaled - mean) / std, dtype=np.float32)


def check_size(width: int, height: int) -> None:
    """A few compressed bytes can declare an image of gigapixels, or a strip whose resize to the
    short edge is gigabytes wide: both are refused before anything is decoded."""
    if width * height > MAX_PIXELS:
        raise ValueError(f"{width} x {height} pixels: at most {MAX_PIXELS:,} an image")
    if max(width, height) > MAX_ASPECT * min(width, height):
        raise ValueError(f"{width} x {height} pixels: the long side at most {MAX_ASPECT} times "
                         "the short one")  # fmt: skip


def prompt_image(pixels: np.ndarray) -> PromptImage:
    data = pixels.astype("<f4", copy=False).tobytes()
    return PromptImage(digest=hashlib.sha256(data).hexdigest(), pixels=data)


async def load_images(urls: list[tuple[str, str]], vision: VisionInfo) -> list[PromptImage]:
    """Each (url, param) fetched and preprocessed, all at once; InvalidRequest naming the first
    that fails. Only the http(s) fetches run on the loop: a data: URL's base64, the decoding,
    the preprocessing and the digest run in threads."""
    if len(urls) > MAX_IMAGES:
        raise InvalidRequest(f"{len(urls)} images: at most {MAX_IMAGES} a request", urls[0][1])
    async with httpx.AsyncClient(timeout=FETCH_TIMEOUT_S) as client:

        async def one(url: str, param: str) -> PromptImage:
            fetched = None if url.startswith("data:") else await fetch(url, param, client)
            return await asyncio.to_thread(_prompt_image, url, fetched, param, vision)

        return list(await asyncio.gather(*(one(url, param) for url, param in urls)))


def _prompt_image(url: str, fetched: bytes | None, param: str, vision: VisionInfo) -> PromptImage:
    """`fetched`: an http(s) URL's body; None for a data: URL, decoded here."""
    data = fetched if fetched is not None else data_url_bytes(url, param)
    try:
        pixels = preprocess(data, vision)
    except ValueError as e:
        raise InvalidRequest(f"the image could not be decoded: {e}", param) from None
    return prompt_image(pixels)


def data_url_bytes(url: str, param: str) -> bytes:
    """A data: URL's bytes, within MAX_IMAGE_BYTES."""
    header, _, payload = url.partition(",")
    if not header.endswith(";base64"):
        raise InvalidRequest("a data: URL image must be base64 (data:image/...;base64,...)",
                             param)  # fmt: skip
    if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise InvalidRequest(f"the image is over {MAX_IMAGE_BYTES} bytes", param)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest("the data: URL is not valid base64", param) from None


async def fetch(url: str, param: str, client: httpx.AsyncClient) -> bytes:
    """An http(s) URL's body, within MAX_IMAGE_BYTES and the timeout."""
    if not url.startswith(("http://", "https://")):
        raise InvalidRequest("an image URL must be http(s):// or data:", param)
    try:
        async with asyncio.timeout(FETCH_TIMEOUT_S):
            async with client.stream("GET", url, follow_redirects=True) as response:
                if response.status_code != 200:
                    raise InvalidRequest(f"fetching the image gave HTTP {response.status_code}",
                                         param)  # fmt: skip
                body = bytearray()
                async for chunk in response.aiter_bytes():
                    body += chunk
                    if len(body) > MAX_IMAGE_BYTES:
                        raise InvalidRequest(f"the image is over {MAX_IMAGE_BYTES} bytes", param)
                return bytes(body)
    except TimeoutError:
        slow = f"fetching the image took over {FETCH_TIMEOUT_S:.0f} s"
        raise InvalidRequest(slow, param) from None
    except httpx.HTTPError as e:
        raise InvalidRequest(f"the image could not be fetched: {e}", param) from None


def expand_placeholders(prompt: list[int], vision: VisionInfo, num_images: int) -> list[int]:
    """Each image token of the rendered prompt repeated to the encoder's rows; InvalidRequest
    when the prompt holds another number of them than images came (a template that drops
    images, or text that spells the token)."""
    found = prompt.count(vision.image_token_id)
    if found != num_images:
        raise InvalidRequest(f"the rendered prompt holds {found} image tokens for {num_images} "
                             "images (is the image token in the text?)", "messages")  # fmt: skip
    out: list[int] = []
    for token in prompt:
        out.extend([token] * vision.num_image_tokens if token == vision.image_token_id else [token])
    return out


async def with_images(
    translating: Awaitable[list[GenerateRequest]],
    urls: list[tuple[str, str]],
    vision: VisionInfo | None,
) -> list[GenerateRequest]:
    """The request's translation (render and tokenize, in its thread) and its images' loading
    at once; the images joined to the request. The translation refuses images for a text model
    (chat.check_images) before any is fetched to no purpose."""
    if not urls or vision is None:
        return await translating
    loading = asyncio.ensure_future(load_images(urls, vision))
    try:
        generates = await translating
        images = await loading
    finally:
        loading.cancel()
    return [msgspec.structs.replace(g, images=images) for g in generates]
