"""The engine an engine worker builds from cluster.yaml (engine/worker_bridge.py)."""

from __future__ import annotations

from common.config import parse_cluster_config
from engine.worker_bridge import engine_config


def test_a_step_budget_left_out_is_the_devices_default() -> None:
    """512 tokens a step on a CPU (as fast per token as 2048 there, and first tokens come
    sooner), 2048 on a GPU; a value in cluster.yaml wins."""
    cpu, cuda = parse_cluster_config("device: cpu\n"), parse_cluster_config("device: cuda\n")
    assert cpu.generation_workers.max_num_batched_tokens is None
    assert engine_config(cpu, 64, None).max_num_batched_tokens == 512
    assert engine_config(cuda, 64, None).max_num_batched_tokens == 2048
    given = parse_cluster_config("context_workers: {max_num_batched_tokens: 96}\n")
    workers = given.context_workers
    assert engine_config(given, 64, workers.max_num_batched_tokens).max_num_batched_tokens == 96


def test_only_engines_that_decode_speculate_and_capture_decode_graphs() -> None:
    """A context worker's engine stops at the first token: no draft model, no decode graphs."""
    config = parse_cluster_config("device: cuda\nspeculative: {method: ngram}\n")
    generation = engine_config(config, 64, None)
    context = engine_config(config, 64, None, decodes=False)
    assert generation.speculative is not None and generation.cuda_graphs
    assert context.speculative is None and not context.cuda_graphs
