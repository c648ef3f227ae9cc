"""What both engine-running workers (context, generation) need around the engine: its settings
from cluster.yaml, token outputs as protocol deltas, and the stats their heartbeats carry."""

from __future__ import annotations

import os

import torch

from common.block_hash import ExtraKey
from common.config import ClusterConfig
from common.protocol import GenerateRequest, TokenDelta, WorkerStats
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine, TokenOutput


def engine_config(
    config: ClusterConfig, max_num_seqs: int, max_num_batched_tokens: int
) -> EngineConfig:
    return EngineConfig(
        model=config.model,
        dtype=config.dtype,
        device=config.device,
        block_size=config.kv_cache.block_size,
        num_blocks=config.kv_cache.num_blocks,
        enable_prefix_caching=config.kv_cache.prefix_caching,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
    )


def configure_torch(config: ClusterConfig) -> None:
    """On CPU, share the cores between the engine processes of one host instead of each taking
    all of them (oversubscribed threads make every step slower)."""
    if config.device == "cpu":
        num_engines = config.generation_workers.count
        if config.mode == "disaggregated":
            num_engines += config.context_workers.count
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // num_engines))


def extra_keys(request: GenerateRequest) -> tuple[ExtraKey, ...]:
    """What salts the request's block hashes: a cache_salt keeps tenants' prefixes apart."""
    return (("cache_salt", request.cache_salt),) if request.cache_salt else ()


def to_delta(out: TokenOutput) -> TokenDelta:
    """One engine output as the wire delta; an aborted sequence (token -1) carries no token."""
    has_token = out.token_id >= 0
    return TokenDelta(
        request_id=out.request_id,
        index=out.index,
        token_ids=[out.token_id] if has_token else [],
        logprobs=[out.logprob] if has_token and out.logprob is not None else None,
        top_logprobs=[out.top_logprobs] if has_token and out.top_logprobs is not None else None,
        finish_reason=out.finish_reason,
        num_prompt_tokens=out.num_prompt_tokens,
        num_cached_tokens=out.num_cached_tokens,
    )


def worker_stats(engine: LLMEngine, active_requests: int) -> WorkerStats:
    usage = engine.kv.usage
    scheduler = engine.scheduler
    active_tokens = sum(s.num_tokens for s in [*scheduler.running, *scheduler.waiting])
    return WorkerStats(
        active_requests=active_requests,
        active_tokens=active_tokens,
        blocks_used=usage.used,
        blocks_cached=usage.cached,
        blocks_total=usage.total,
        blocks_leased=engine.num_held_blocks,
        prompt_tokens_computed=engine.num_prompt_tokens_computed,
    )
