"""The int8 KV cache handed off between engines over a real NIXL READ (its blocks are one byte
range each, scales inline, moved unchanged), and a peer whose pool holds another layout in
blocks of the same byte count refused at add_peer instead of read as garbage."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from common.sampling_params import SamplingParams
from engine.config import EngineConfig
from engine.kv_cache import KVCache
from engine.kv_transfer import KVTransferAgent, KVTransferError
from engine.llm_engine import LLMEngine, TokenOutput
from engine.model_config import ModelConfig, RopeConfig
from tools.tiny_model.build import TEST_PROMPTS

BLOCK_SIZE = 4
TIMEOUT_S = 20.0


def run_to_end(engine: LLMEngine) -> list[TokenOutput]:
    outputs: list[TokenOutput] = []
    while engine.has_unfinished():
        outputs += engine.step()
    return outputs


def agent(name: str, engine: LLMEngine) -> KVTransferAgent:
    cache = engine.kv_cache
    return KVTransferAgent(name, cache.pool, cache.block_num_bytes, cache.layout)


def test_int8_blocks_read_over_nixl_decode_like_one_engine(tiny_model_path: Path) -> None:
    config = EngineConfig(
        model=str(tiny_model_path), num_blocks=128, block_size=BLOCK_SIZE, kv_cache_dtype="int8"
    )
    context, generation, reference = (LLMEngine(config) for _ in range(3))
    assert context.kv_cache.pool.dtype == torch.int8
    params = SamplingParams(temperature=0.0, max_tokens=10)
    with agent("ctx-int8", context) as source, agent("gen-int8", generation) as reader:
        reader.add_peer(source.info())
        for i, text in enumerate(TEST_PROMPTS[:3]):
            prompt = [int(t) for t in text.encode()[:30]]
            context.add_request(f"r{i}", prompt, params, prefill_only=True)
            (first,) = run_to_end(context)
            source_table = context.held_block_table(f"r{i}")
            planned = generation.add_pulled_request(f"r{i}", prompt, params, {0: first.token_id})
            assert planned is not None
            table, num_valid = planned
            start = num_valid // BLOCK_SIZE
            handle = reader.start_read("ctx-int8", source_table[start:], table[start:], b"x")
            deadline = time.monotonic() + TIMEOUT_S
            while (state := reader.poll(handle)) == "pending" and time.monotonic() < deadline:
                time.sleep(0.001)
            assert state == "done", handle.error
            reader.release(handle)
            moved = generation.kv_cache.pool[table[start:]]
            assert torch.equal(moved, context.kv_cache.pool[source_table[start:]])
            generation.pull_done(f"r{i}")
            context.release_held(f"r{i}")
            got = [first.token_id] + [o.token_id for o in run_to_end(generation)]
            reference.add_request(f"r{i}", prompt, params)
            assert got == [o.token_id for o in run_to_end(reference)]


def test_a_peer_whose_blocks_hold_another_layout_is_refused() -> None:
    """head_dim 64: a bfloat16 block of 17 tokens and an int8 one of 32 are both 17408 bytes."""
    config = ModelConfig(
        model_type="llama", vocab_size=100, hidden_size=128, intermediate_size=256,
        num_layers=2, num_heads=2, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6,
        rope=RopeConfig(kind="default", theta=10000.0), max_position_embeddings=256,
        tie_word_embeddings=True, attention_bias=False, qk_norm=False, sliding_window=None,
        eos_token_ids=(0,), torch_dtype="float32",
    )  # fmt: skip
    int8 = KVCache(config, 8, 32, torch.int8, "cpu")
    bf16 = KVCache(config, 8, 17, torch.bfloat16, "cpu")
    assert int8.block_num_bytes == bf16.block_num_bytes == 17408
    with (
        KVTransferAgent("ctx-i8", int8.pool, int8.block_num_bytes, int8.layout) as source,
        KVTransferAgent("gen-bf16", bf16.pool, bf16.block_num_bytes, bf16.layout) as reader,
    ):
        with pytest.raises(KVTransferError, match="stores its KV as 'int8 kv, 2 layers x 32"):
            reader.add_peer(source.info())
        assert reader.peer_names == []
