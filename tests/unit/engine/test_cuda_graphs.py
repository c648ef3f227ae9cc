"""engine/cuda_graphs.py's bookkeeping on a CPU: bucket choice, the padding of a decode batch, the
graphs a changed KV pool drops, and the engine's greedy tokens through the padded static buffers
(replayed eagerly: capture=False) against the engine without them. The capture itself runs only
on a GPU: test_captured_decode_matches_eager_on_the_gpu, and bench/gpu_parity.py in gpu_run.sh."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import msgspec
import pytest
import torch

from common.sampling_params import SamplingParams
from engine.cuda_graphs import (
    PAD_SLOT,
    DecodeGraphs,
    Fingerprint,
    bucket_for,
    buckets_for,
    empty_padded,
    pad_decode,
)
from engine.kv_cache import KVCache
from engine.llm import LLM
from tools.tiny_model.build import TEST_PROMPTS

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def test_buckets_are_powers_of_two_to_8_then_multiples_of_8_and_the_maximum() -> None:
    assert buckets_for(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert buckets_for(12) == (1, 2, 4, 8, 12)
    assert buckets_for(6) == (1, 2, 4, 6)
    assert buckets_for(1) == (1,)
    buckets = buckets_for(64)
    assert [bucket_for(n, buckets) for n in (1, 3, 5, 9, 17, 63, 64)] == [1, 4, 8, 16, 24, 64, 64]
    assert bucket_for(65, buckets) is None and bucket_for(0, buckets) is None


def test_a_batch_is_padded_with_rows_that_write_no_kv() -> None:
    out = empty_padded(4, 5, "cpu")
    out.block_tables.fill_(7)  # what an earlier, wider step left in the staging buffers
    pad_decode([11, 12], [30, 4], [483, 65], [[30, 31], [4]], [31, 5], out)
    assert out.token_ids.tolist() == [11, 12, 0, 0]
    assert out.positions.tolist() == [30, 4, 0, 0]
    assert out.slots.tolist() == [483, 65, PAD_SLOT, PAD_SLOT]
    assert out.context_lens.tolist() == [31, 5, 1, 1]
    assert out.block_tables.tolist() == [[30, 31, 0, 0, 0], [4, 0, 0, 0, 0], [0] * 5, [0] * 5]
    with pytest.raises(ValueError, match="do not fit"):
        pad_decode([1] * 5, [0] * 5, [0] * 5, [[0]] * 5, [1] * 5, out)
    with pytest.raises(ValueError, match="graphs hold 5"):
        pad_decode([1], [0], [0], [[0] * 6], [1], out)


def engine(tiny_model_path: Path, **options: object) -> LLM:
    return LLM(str(tiny_model_path), attention_backend="torch", num_blocks=128, **options)


def test_a_bucket_is_captured_once_and_a_moved_kv_pool_drops_every_graph(
    tiny_model_path: Path,
) -> None:
    llm = engine(tiny_model_path, max_num_seqs=8)
    e = llm.engine
    graphs = DecodeGraphs(e.model, e.kv_cache, "torch", "cpu", 8, 8, capture=False)
    one = ([5], [3], [3], [[0]], [4])
    graphs.run(*one)
    graphs.run(*one)
    graphs.run([5, 6, 7], [3, 3, 3], [3, 19, 35], [[0], [1], [2]], [4, 4, 4])  # bucket 4
    assert graphs.num_captures == 2 and sorted(graphs.graphs) == [1, 4]
    assert graphs.run(*([5] * 9, [3] * 9, [3] * 9, [[0]] * 9, [4] * 9)) is None  # past 8: eager
    assert not graphs.fits(1, [[0] * 9])  # wider than the graphs' block tables
    moved = KVCache(e.model_config, 128, e.config.block_size, torch.float32, "cpu")
    graphs.kv_cache = moved  # what the captured graphs read has moved
    assert Fingerprint.of(moved) != graphs.fingerprint
    graphs.run(*one)
    assert graphs.num_captures == 3 and sorted(graphs.graphs) == [1]


def test_padding_rows_leave_the_kv_pool_as_they_found_it(tiny_model_path: Path) -> None:
    llm = engine(tiny_model_path, max_num_seqs=8)
    e = llm.engine
    graphs = DecodeGraphs(e.model, e.kv_cache, "torch", "cpu", 8, 8, capture=False)
    block_size = e.config.block_size
    slots = [0 * block_size + 3, 2 * block_size + 3, 4 * block_size + 3]
    before = e.kv_cache.pool.clone()
    hidden = graphs.run([5, 6, 7], [3, 3, 3], slots, [[0], [2], [4]], [4, 4, 4])  # 1 pad row
    assert hidden is not None and hidden.shape == (3, e.model_config.hidden_size)
    changed = (e.kv_cache.pool != before).flatten(1).any(1).nonzero().flatten().tolist()
    assert changed == [0, 2, 4]  # the three real rows' blocks, nothing for the padding row
    written = e.kv_cache.pool.view(e.kv_cache.pool.shape[0], -1, block_size, *before.shape[-2:])
    untouched = [s for s in range(block_size) if s != 3]
    assert torch.equal(written[:, :, untouched], before.view_as(written)[:, :, untouched])


def test_greedy_tokens_through_the_padded_buffers_equal_the_eager_engines(
    tiny_model_path: Path,
) -> None:
    """Ten prompts of 4 to 22 new tokens, at most 6 running at a time: decode steps of 6, 5, ...
    1 sequences padded to buckets 6, 4, 2, 1, steps with prefill chunks eager, the same tokens as
    without graphs."""
    prompts = list(TEST_PROMPTS)
    params = [msgspec.structs.replace(GREEDY, max_tokens=4 + 2 * i) for i in range(len(prompts))]
    expected = engine(tiny_model_path, max_num_seqs=6).generate(prompts, params)
    llm = engine(tiny_model_path, max_num_seqs=6)
    e = llm.engine
    graphs = DecodeGraphs(e.model, e.kv_cache, "torch", "cpu", 6, 16, capture=False)
    runs: list[int] = []
    run = graphs.run
    graphs.run = lambda *a: runs.append(len(a[0])) or run(*a)  # type: ignore[method-assign]
    e.runner.graphs = graphs
    got = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert {1, 3, 6} <= set(runs) and graphs.num_captures == 4  # buckets 1, 2, 4 and 6


def test_the_engine_config_turns_graphs_on_only_on_a_gpu(tiny_model_path: Path) -> None:
    llm = engine(tiny_model_path)
    assert llm.engine.config.cuda_graphs and llm.engine.runner.graphs is None  # a CPU
    off = dataclasses.replace(llm.engine.config, cuda_graphs=False)
    assert not off.cuda_graphs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (bench/gpu_run.sh runs it)")
def test_captured_decode_matches_eager_on_the_gpu(tiny_model_path: Path) -> None:
    """float32 on the GPU: the same greedy tokens with graphs (every bucket captured at start)
    as without, and the graphs replayed."""
    prompts = list(TEST_PROMPTS)
    eager = LLM(str(tiny_model_path), device="cuda", cuda_graphs=False, max_num_seqs=8)
    expected = [o.outputs[0].token_ids for o in eager.generate(prompts, GREEDY)]
    del eager
    llm = LLM(str(tiny_model_path), device="cuda", max_num_seqs=8)
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.enabled and sorted(graphs.graphs) == [1, 2, 4, 8]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == expected
    assert graphs.enabled
