"""The engine an engine worker builds from cluster.yaml (engine/worker_bridge.py)."""

from __future__ import annotations

import pytest

from common.config import parse_cluster_config
from engine.config import EngineConfig
from engine.worker_bridge import engine_config


def test_a_step_budget_left_out_is_the_devices_default() -> None:
    """2048 tokens a step on either device (vLLM's servers'); on a CPU a step starts prompt
    chunks only below 512 tokens (first tokens come sooner where the matmuls are as fast per
    token at 512 rows), on a GPU up to the budget; a value in cluster.yaml wins, and a budget
    set below the fill lowers the fill with it."""
    cpu, cuda = parse_cluster_config("device: cpu\n"), parse_cluster_config("device: cuda\n")
    assert cpu.generation_workers.max_num_batched_tokens is None
    on_cpu = engine_config(cpu, cpu.generation_workers)
    on_cuda = engine_config(cuda, cuda.generation_workers)
    assert (on_cpu.max_num_batched_tokens, on_cpu.step_fill_tokens) == (2048, 512)
    assert (on_cuda.max_num_batched_tokens, on_cuda.step_fill_tokens) == (2048, None)
    given = parse_cluster_config("context_workers: {max_num_batched_tokens: 96}\n")
    built = engine_config(given, given.context_workers)
    assert (built.max_num_batched_tokens, built.step_fill_tokens) == (96, 96)
    given = parse_cluster_config("context_workers: {step_fill_tokens: 1024}\n")
    assert engine_config(given, given.context_workers).step_fill_tokens == 1024


def test_a_fill_past_the_budget_is_refused_at_load() -> None:
    for text in ("generation_workers: {max_num_batched_tokens: 256, step_fill_tokens: 512}\n",
                 "context_workers: {step_fill_tokens: 4096}\n"):  # fmt: skip
        with pytest.raises(ValueError, match="step_fill_tokens"):
            parse_cluster_config(text)


def test_only_engines_that_decode_speculate_and_capture_decode_graphs() -> None:
    """A context worker's engine stops at the first token: no draft model, no decode graphs."""
    config = parse_cluster_config("device: cuda\nspeculative: {method: ngram}\n")
    generation = engine_config(config, config.generation_workers)
    context = engine_config(config, config.context_workers, decodes=False)
    assert generation.speculative is not None and generation.cuda_graphs
    assert context.speculative is None and not context.cuda_graphs


def test_the_engine_refuses_a_fill_outside_its_budget() -> None:
    for fill in (0, 2049):
        with pytest.raises(ValueError, match="step_fill_tokens"):
            EngineConfig(model="builtin:tiny", step_fill_tokens=fill)
    assert EngineConfig(model="builtin:tiny", step_fill_tokens=2048).step_fill_tokens == 2048
