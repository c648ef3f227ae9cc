"""The offload tier in the engine, on the tiny model: a multi-turn workload whose working set is
about 4x the pool keeps its greedy tokens, computes fewer prompt tokens, and frees everything."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import pytest

from common.config import KVOffloadConfig
from common.sampling_params import SamplingParams
from engine.llm import LLM
from engine.worker_bridge import worker_stats

BLOCK_SIZE = 4
NUM_BLOCKS = 24  # the pool: 96 tokens
NUM_CONVERSATIONS = 6
NUM_TURNS = 4
TURN_TOKENS = 12  # each user turn; a conversation ends near 4 x (12 + 6) = 72 tokens
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def multi_turn(llm: LLM, seed: int = 0) -> list[list[int]]:
    """Conversations taken in turns, round robin: each turn's prompt is its conversation so far
    (every earlier prompt and answer) plus a new user turn, so between two turns of one
    conversation the others' turns push its blocks out of the pool."""
    rng = random.Random(seed)
    vocab = llm.engine.model_config.vocab_size
    history: list[list[int]] = [[] for _ in range(NUM_CONVERSATIONS)]
    answers = []
    for _ in range(NUM_TURNS):
        for conversation in history:
            conversation += [rng.randrange(10, vocab) for _ in range(TURN_TOKENS)]
            [result] = llm.generate([list(conversation)], GREEDY)
            answer = result.outputs[0].token_ids
            conversation += answer
            answers.append(answer)
    working_set_blocks = sum(len(c) for c in history) // BLOCK_SIZE
    assert working_set_blocks >= 4 * NUM_BLOCKS
    return answers


@dataclass(frozen=True, slots=True)
class Baseline:
    answers: list[list[int]]
    prompt_tokens_computed: int
    block_num_bytes: int


@pytest.fixture(scope="module")
def without_tier(tiny_model_path: Path) -> Baseline:
    llm = LLM(str(tiny_model_path), num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    answers = multi_turn(llm)
    assert_all_freed(llm)
    return Baseline(
        answers, llm.engine.num_prompt_tokens_computed, llm.engine.kv_cache.block_num_bytes
    )


def assert_all_freed(llm: LLM) -> None:
    usage = llm.engine.kv.usage
    assert usage.used == 0 and usage.free + usage.cached == usage.total, usage
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("level", ["host", "host+disk"])
def test_multi_turn_with_the_tier_keeps_tokens_and_computes_less(
    tiny_model_path: Path, without_tier: Baseline, tmp_path: Path, level: str
) -> None:
    block_bytes = without_tier.block_num_bytes
    if level == "host":  # room for the whole working set
        config = KVOffloadConfig(host_bytes=5 * NUM_BLOCKS * block_bytes)
    else:  # a host tier as small as the pool, the rest on disk
        config = KVOffloadConfig(
            host_bytes=NUM_BLOCKS * block_bytes,
            disk_path=str(tmp_path),
            disk_bytes=5 * NUM_BLOCKS * block_bytes,
        )
    llm = LLM(str(tiny_model_path), num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, kv_offload=config)
    offload = llm.engine.kv.offload
    assert offload is not None
    try:
        assert multi_turn(llm) == without_tier.answers
        assert offload.num_restored_blocks > 0
        assert (offload.num_disk_restored_blocks > 0) == (level == "host+disk")
        computed = llm.engine.num_prompt_tokens_computed
        assert computed < 0.6 * without_tier.prompt_tokens_computed, (
            computed,
            without_tier.prompt_tokens_computed,
        )
        assert_all_freed(llm)
        stats = worker_stats(llm.engine, 0)  # what heartbeats carry to /metrics
        assert stats.kv_offload_stored_blocks == offload.num_offloaded_blocks > 0
        assert stats.kv_offload_restored_blocks == offload.num_restored_blocks
        assert stats.kv_offload_disk_restored_blocks == offload.num_disk_restored_blocks
        assert stats.kv_offload_host_blocks == len(offload.host) > 0
        assert (stats.kv_offload_disk_blocks > 0) == (level == "host+disk")
    finally:
        offload.close()
    if offload.disk is not None:
        assert not offload.disk.directory.exists()
