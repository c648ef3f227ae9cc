"""A prompt with images through the context and generation workers without sockets, on
builtin:tiny-llava (tests/unit/worker_doubles.py's in-process NIXL): the context worker encodes
the images and the generation worker, which gets their digests only, decodes from the pulled KV
as one engine given the images does; a prompt whose KV cannot be read fails (503) instead of
being prefilled again without its images."""

from __future__ import annotations

import hashlib
from pathlib import Path

import msgspec
import pytest

from common.protocol import GenerateRequest, PromptImage, RequestFailed
from common.sampling_params import SamplingParams
from engine.builtin_build import ensure_builtin
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from tests.unit.engine.test_llava import pixels, prompt_with
from tests.unit.generation_worker.test_worker import Pair, pair_of, reference_tokens, tokens_out
from tests.unit.worker_doubles import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    decode_request,
    generate_request,
    sent,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPT = prompt_with(2, [11, 12, 13])


@pytest.fixture(scope="module")
def llava_path() -> Path:
    return ensure_builtin("builtin:tiny-llava")


@pytest.fixture(scope="module")
def engines(llava_path: Path) -> tuple[LLMEngine, LLMEngine, LLMEngine]:
    config = EngineConfig(model=str(llava_path), num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    return LLMEngine(config), LLMEngine(config), LLMEngine(config)


@pytest.fixture
def pair(llava_path: Path, engines) -> Pair:
    context_engine, generation_engine, _ = engines
    yield pair_of(llava_path, engines)
    for engine in (context_engine, generation_engine):
        assert not engine.has_unfinished()
        assert engine.kv_usage.used == 0 and engine.num_held_blocks == 0


def with_images(request_id: str, seeds: list[int], prompt: list[int] = PROMPT) -> GenerateRequest:
    """A request as the frontend makes it: each image's float32 pixels and their digest."""
    images = []
    for seed in seeds:
        data = pixels(seed).numpy().tobytes()
        images.append(PromptImage(digest=hashlib.sha256(data).hexdigest(), pixels=data))
    request = generate_request(request_id, prompt, GREEDY)
    return msgspec.structs.replace(request, images=images)


def test_the_generation_worker_decodes_a_pulled_image_prompt(pair: Pair, engines) -> None:
    request = with_images("img", [1, 2])
    done = pair.prefill(request)
    decode = decode_request(request, done)
    assert [image.pixels for image in decode.request.images] == [b"", b""]  # digests only
    out = pair.decode(decode)
    reference = engines[2]
    reference.add_request("reference", PROMPT, GREEDY, images=[pixels(1), pixels(2)])
    expected = []
    while reference.has_unfinished():
        expected += [o.token_id for o in reference.step()]
    assert tokens_out(out) == expected
    assert pair.generation.stats().prompts_recomputed == 0
    pair.context.step(pair.clock.now)
    # another image, the same tokens: another answer (the images reach the model)
    other = pair.decode(decode_request(with_images("other", [3, 4]),
                                       pair.prefill(with_images("other", [3, 4]))))  # fmt: skip
    assert tokens_out(other) != expected
    pair.context.step(pair.clock.now)


def test_an_image_prompt_whose_lease_ran_out_fails_instead_of_losing_its_images(pair) -> None:
    request = with_images("img-late", [5], prompt_with(1, [7]))
    done = pair.prefill(request)
    pair.clock.now += done.lease_s - 1.0  # too little left to read it
    out = pair.decode(decode_request(request, done))
    failed = [m for m in sent(out) if isinstance(m, RequestFailed)]
    assert len(failed) == 1 and failed[0].status_code == 503 and "images" in failed[0].message
    assert pair.generation.stats().prompts_recomputed == 0
    pair.context.step(pair.clock.now)
    assert pair.context.idle(pair.clock.now)


def test_a_text_prompt_is_still_prefilled_here_when_its_lease_ran_out(pair, engines) -> None:
    text = [21, 22, 23, 24, 25, 26]
    request = generate_request("txt-late", text, GREEDY)
    done = pair.prefill(request)
    pair.clock.now += done.lease_s - 1.0
    out = pair.decode(decode_request(request, done))
    assert tokens_out(out) == reference_tokens(engines[2], text, GREEDY)
    assert pair.generation.stats().prompts_recomputed == 1
    pair.context.step(pair.clock.now)
