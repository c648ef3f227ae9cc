"""A LLaVA-style model (builtin:tiny-llava: CLIP tower, projector, Llama) in the engine against
transformers' LlavaForConditionalGeneration on the same checkpoint: greedy tokens equal with one
and two images, chunked prefills cutting through an image's placeholders, images salting the
prefix cache; and the refusals of what cannot pair up."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.errors import InvalidRequest
from common.sampling_params import SamplingParams
from engine.builtin_build import ensure_builtin
from engine.llm import LLM
from engine.prompt_images import image_key
from tools.tiny_arch.llava import IMAGE_SIZE, IMAGE_TOKEN_ID

NUM_IMAGE_TOKENS = (IMAGE_SIZE // 14) ** 2
MAX_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def llava_path() -> Path:
    return ensure_builtin("builtin:tiny-llava")


@pytest.fixture(scope="module")
def llm(llava_path: Path) -> LLM:
    return LLM(str(llava_path), num_blocks=256, block_size=4)


def pixels(seed: int) -> torch.Tensor:
    return torch.randn(3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(seed))


def prompt_with(num_images: int, text: list[int]) -> list[int]:
    """Text, then each image's placeholder run followed by more text."""
    ids = list(text)
    for i in range(num_images):
        ids += [IMAGE_TOKEN_ID] * NUM_IMAGE_TOKENS + [100 + i, 200 + i, 300 + i]
    return ids


def hf_greedy(path: Path, prompt: list[int], images: list[torch.Tensor]) -> list[int]:
    from transformers import LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    inputs = {"input_ids": torch.tensor([prompt])}
    if images:
        inputs["pixel_values"] = torch.stack(images)
    with torch.no_grad():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=MAX_NEW,
                             min_new_tokens=MAX_NEW, pad_token_id=4070)  # fmt: skip
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("num_images", [0, 1, 2])
def test_greedy_tokens_equal_transformers(llava_path: Path, llm: LLM, num_images: int) -> None:
    images = [pixels(seed) for seed in range(num_images)]
    prompt = prompt_with(num_images, [11, 12, 13, 14, 15])
    assert run(llm, prompt, images) == hf_greedy(llava_path, prompt, images)
    assert llm.engine.kv.usage.used == 0


def run(
    llm: LLM, prompt: list[int], images: list[torch.Tensor], request_id: str = "r"
) -> list[int]:
    engine = llm.engine
    engine.add_request(request_id, prompt, GREEDY, images=images)
    tokens: list[int] = []
    while engine.has_unfinished():
        tokens += [out.token_id for out in engine.step() if out.token_id >= 0]
    return tokens


def test_prefill_chunks_that_cut_through_images(llava_path: Path, llm: LLM) -> None:
    """A 7-token budget: chunks start and end inside both images' runs."""
    chunked = LLM(str(llava_path), num_blocks=256, block_size=4, max_num_batched_tokens=7)
    images = [pixels(10), pixels(11)]
    prompt = prompt_with(2, [21, 22, 23])
    assert run(chunked, prompt, images) == run(llm, prompt, images)


def test_an_image_salts_the_prefix_cache(llm: LLM) -> None:
    """The same tokens with another image share no block; with the same image they do."""
    prompt = prompt_with(1, list(range(30, 50)))
    first = run(llm, prompt, [pixels(20)], "a")
    engine = llm.engine
    hits = engine.admission.prefix_cache_hit_tokens
    other = run(llm, prompt, [pixels(21)], "b")
    assert engine.admission.prefix_cache_hit_tokens == hits
    again = run(llm, prompt, [pixels(20)], "c")
    assert engine.admission.prefix_cache_hit_tokens > hits
    assert again == first and other != first  # the image is what the model answers
    assert image_key(pixels(20)) != image_key(pixels(21))


@pytest.mark.parametrize(
    ("prompt", "num_images", "match"),
    [
        (prompt_with(1, [5]), 0, "1 image placeholder runs and 0 images"),
        (prompt_with(1, [5]), 2, "1 image placeholder runs and 2 images"),
        ([5, *[IMAGE_TOKEN_ID] * (NUM_IMAGE_TOKENS - 1), 6], 1, "each image takes"),
    ],
)
def test_images_and_placeholders_that_do_not_pair_up_are_refused(
    llm: LLM, prompt: list[int], num_images: int, match: str
) -> None:
    with pytest.raises(InvalidRequest, match=match):
        llm.engine.add_request("bad", prompt, GREEDY, images=[pixels(i) for i in range(num_images)])
    assert not llm.engine.has_unfinished() and llm.engine.kv.usage.used == 0


def test_wrong_pixels_and_text_models_are_refused(llm: LLM, tiny_model_path: Path) -> None:
    small = torch.zeros(3, IMAGE_SIZE // 2, IMAGE_SIZE // 2)
    with pytest.raises(InvalidRequest, match="pixel values of shape"):
        llm.engine.add_request("bad", prompt_with(1, [5]), GREEDY, images=[small])
    with pytest.raises(InvalidRequest, match="text only"):
        LLM(str(tiny_model_path), num_blocks=64).engine.add_request(
            "bad", [1, 2, 3], GREEDY, images=[pixels(0)]
        )


def test_a_prompt_with_images_is_not_recomputed_without_them(llm: LLM) -> None:
    """A generation worker holds no pixels: it must fail such a prompt, never prefill its
    placeholders as text."""
    assert llm.engine.needs_images(prompt_with(1, [5]))
    with pytest.raises(InvalidRequest, match="without them"):
        llm.engine.add_continued_request("c", prompt_with(1, [5]), GREEDY, {0: 7})
    assert not llm.engine.needs_images([5, 6, 7])
    # a pull of one that failed: no recompute, even asked; ending it frees everything
    assert llm.engine.add_pulled_request("p", prompt_with(1, [5]), GREEDY, {0: 7}) is not None
    with pytest.raises(InvalidRequest, match="without them"):
        llm.engine.pull_failed("p", recompute=True)
    assert "p" in llm.engine.scheduler.pulling
    assert [out.finish_reason for out in llm.engine.pull_failed("p", recompute=False)] == ["abort"]
    assert not llm.engine.has_unfinished() and llm.engine.kv.usage.used == 0
