"""The engine hooks of disaggregation, without sockets: a prefill-only engine holds the prompt's
blocks; a second engine admits the request with those blocks copied in (what the NIXL READ does)
and decodes the same tokens as one engine doing both."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.sampling_params import SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine, TokenOutput
from tools.tiny_model.build import TEST_PROMPTS

BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def engines(tiny_model_path: Path) -> tuple[LLMEngine, LLMEngine, LLMEngine]:
    """(context, generation, reference) engines on the tiny model."""
    config = EngineConfig(model=str(tiny_model_path), num_blocks=256, block_size=BLOCK_SIZE)
    return LLMEngine(config), LLMEngine(config), LLMEngine(config)


def run_to_end(engine: LLMEngine) -> list[TokenOutput]:
    outputs: list[TokenOutput] = []
    while engine.has_unfinished():
        outputs += engine.step()
    return outputs


def tokens_by_choice(outputs: list[TokenOutput]) -> dict[int, list[int]]:
    by_choice: dict[int, list[int]] = {}
    for out in outputs:
        by_choice.setdefault(out.index, []).append(out.token_id)
    return by_choice


def prefill_and_pull(
    context: LLMEngine, generation: LLMEngine, request_id: str, prompt: list[int], params
) -> dict[int, list[int]]:
    context.add_request(request_id, prompt, params, prefill_only=True)
    first = run_to_end(context)
    assert {o.index for o in first} == set(range(params.n))
    assert all(o.finish_reason is None for o in first)
    source_table = context.held_block_table(request_id)
    assert len(source_table) == -(-len(prompt) // BLOCK_SIZE)

    planned = generation.add_pulled_request(
        request_id, prompt, params, {o.index: o.token_id for o in first}
    )
    assert planned is not None
    table, num_valid = planned
    start = num_valid // BLOCK_SIZE
    for src, dst in zip(source_table[start:], table[start:], strict=True):  # the "READ"
        generation.kv_cache.pool[dst] = context.kv_cache.pool[src]
    generation.pull_done(request_id)
    context.release_held(request_id)
    rest = tokens_by_choice(run_to_end(generation))
    return {o.index: [o.token_id, *rest[o.index]] for o in first}


def test_pulled_request_decodes_like_one_engine(engines) -> None:
    context, generation, reference = engines
    params = SamplingParams(temperature=0.0, max_tokens=12)
    for i, text in enumerate(TEST_PROMPTS[:4]):
        prompt = [int(t) for t in text.encode()[:40]]  # byte values: valid ids in the tiny vocab
        got = prefill_and_pull(context, generation, f"r{i}", prompt, params)
        reference.add_request(f"r{i}", prompt, params)
        assert got == tokens_by_choice(run_to_end(reference))
    for engine in engines:
        assert engine.kv.usage.used == 0
        assert engine.num_held_blocks == 0


def test_second_pull_of_a_shared_prompt_reads_only_uncached_blocks(engines) -> None:
    context, generation, _ = engines
    prompt = list(range(100, 130))  # 7 full blocks + 2 tokens
    params = SamplingParams(temperature=0.0, max_tokens=4)
    prefill_and_pull(context, generation, "warm", prompt, params)
    context.add_request("again", prompt, params, prefill_only=True)
    first = run_to_end(context)
    planned = generation.add_pulled_request("again", prompt, params, {0: first[0].token_id})
    assert planned is not None
    table, num_valid = planned
    assert num_valid == 28  # every full block was in the generation worker's own prefix cache
    assert len(table) == 8
    generation.abort("again")
    context.abort("again")
    assert generation.kv.usage.used == 0 and context.kv.usage.used == 0


def test_seeded_n_choices_share_the_pulled_prompt_and_sample_like_one_engine(engines) -> None:
    """A seeded draw depends on (seed, choice, position) only: the first token sampled on the
    context engine and the rest on the generation engine are what one engine samples."""
    context, generation, reference = engines
    prompt = list(range(200, 219))
    params = SamplingParams(temperature=1.0, max_tokens=12, n=3, seed=5)
    got = prefill_and_pull(context, generation, "n3", prompt, params)
    assert sorted(got) == [0, 1, 2]
    assert all(len(tokens) == 12 for tokens in got.values())
    reference.add_request("n3", prompt, params)
    assert got == tokens_by_choice(run_to_end(reference))
    assert len({tuple(tokens) for tokens in got.values()}) == 3  # the choices differ
    assert context.kv.usage.used == 0 and generation.kv.usage.used == 0


def test_failed_pull_frees_blocks_or_recomputes(engines) -> None:
    context, generation, reference = engines
    prompt = list(range(300, 322))
    params = SamplingParams(temperature=0.0, max_tokens=5)
    reference.add_request("ref", prompt, params)
    expected = tokens_by_choice(run_to_end(reference))[0]

    assert generation.add_pulled_request("lost", prompt, params, {0: expected[0]}) is not None
    aborted = generation.pull_failed("lost", recompute=False)
    assert [o.finish_reason for o in aborted] == ["abort"]
    assert generation.kv.usage.used == 0 and not generation.has_unfinished()

    assert generation.add_pulled_request("again", prompt, params, {0: expected[0]}) is not None
    assert generation.pull_failed("again", recompute=True) == []
    assert [expected[0], *tokens_by_choice(run_to_end(generation))[0]] == expected
    assert generation.kv.usage.used == 0


def test_abort_frees_held_and_pulling_blocks(engines) -> None:
    context, generation, _ = engines
    prompt = list(range(400, 420))
    params = SamplingParams(temperature=0.0, max_tokens=5)
    context.add_request("held", prompt, params, prefill_only=True)
    run_to_end(context)
    assert context.num_held_blocks == 5
    context.abort("held")
    assert context.num_held_blocks == 0 and context.kv.usage.used == 0
    generation.add_pulled_request("pulling", prompt, params, {0: 1})
    assert [o.finish_reason for o in generation.abort("pulling")] == ["abort"]
    assert generation.kv.usage.used == 0


def test_first_token_that_ends_the_request_is_reported_by_the_context_engine(engines) -> None:
    context, _, _ = engines
    context.add_request(
        "one", list(range(500, 510)), SamplingParams(max_tokens=1), prefill_only=True
    )
    (out,) = run_to_end(context)
    assert out.finish_reason == "length"
    context.release_held("one")
    assert context.kv.usage.used == 0
