"""The bridge between the engine and the engine workers (context, generation): the engine built
from cluster.yaml, its token outputs as protocol deltas, the stats their heartbeats carry, and
its KV events relayed to the orchestrator."""

from __future__ import annotations

import os

import torch
import zmq

from common.config import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_STEP_FILL_TOKENS,
    ClusterConfig,
    ContextWorkersConfig,
    GenerationWorkersConfig,
)
from common.cpu_placement import place_engine
from common.kv_events import KVEventPublisher
from common.protocol import KVEvents, TokenDelta, WorkerStats
from engine.config import EngineConfig
from engine.kv_transfer import KVTransferAgent
from engine.llm_engine import LLMEngine, TokenOutput
from engine.ucx_network import ucx_environment


def engine_config(
    config: ClusterConfig,
    workers: ContextWorkersConfig | GenerationWorkersConfig,
    decodes: bool = True,
) -> EngineConfig:
    """`decodes`: the engine decodes past the first token (a generation worker, aggregated or
    not); a context worker's does not, and loads no draft model nor captures decode graphs."""
    max_num_batched_tokens = (
        workers.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS[config.device]
    )
    step_fill_tokens = workers.step_fill_tokens
    if step_fill_tokens is None and (default := DEFAULT_STEP_FILL_TOKENS[config.device]):
        step_fill_tokens = min(default, max_num_batched_tokens)  # a smaller budget set wins
    return EngineConfig(
        model=config.model,
        dtype=config.dtype,
        device=config.device,
        block_size=config.kv_cache.block_size,
        num_blocks=config.kv_cache.num_blocks,
        enable_prefix_caching=config.kv_cache.prefix_caching,
        kv_cache_dtype=config.kv_cache.dtype,
        kv_offload=config.kv_cache.offload,
        quantization=config.quantization,
        lora=config.lora,
        speculative=config.speculative if decodes else None,
        cuda_graphs=decodes,
        max_num_seqs=workers.max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        step_fill_tokens=step_fill_tokens,
        max_model_len=config.max_model_len,
    )


def build_engine(
    config: ClusterConfig, worker_id: str, workers: ContextWorkersConfig | GenerationWorkersConfig
) -> tuple[LLMEngine, KVTransferAgent]:
    """An engine worker's engine and the NIXL agent over its KV pool (one per process). UCX is
    confined first (engine/ucx_network.py): it reads its settings when the agent is made."""
    if config.device == "cpu":
        torch.set_num_threads(place_engine(config, worker_id))
    os.environ.update(ucx_environment(config.internal_host, config.port_range))
    decodes = isinstance(workers, GenerationWorkersConfig)
    engine = LLMEngine(engine_config(config, workers, decodes))
    kv_cache = engine.kv_cache
    agent = KVTransferAgent(
        f"{worker_id}-{os.getpid()}", kv_cache.pool, kv_cache.block_num_bytes, kv_cache.layout
    )
    return engine, agent


def event_endpoints(config: ClusterConfig, worker_id: str) -> tuple[str | None, str | None]:
    """This worker's KV-event PUB and replay endpoints (None: not publishing). On a loopback
    address every engine worker shares one host, so each takes the base port + its position
    among the engine workers; elsewhere (a pod each) they all bind the configured port."""
    events = config.kv_cache.events
    role, _, index = worker_id.rpartition("-")
    offset = int(index) if index.isdigit() else 0
    if role == "ctx":
        offset += config.generation_workers.count
    return _offset(events.zmq, offset), _offset(events.replay_zmq, offset)


def _offset(endpoint: str | None, offset: int) -> str | None:
    if endpoint is None:
        return None
    base, _, port = endpoint.rpartition(":")
    loopback = base.endswith(("//127.0.0.1", "//localhost", "//[::1]"))
    return f"{base}:{int(port) + offset}" if loopback and port.isdigit() else endpoint


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
        prompt_logprobs=out.prompt_logprobs,
        embedding=out.embedding,
        beam_candidates=out.beam_candidates,
    )


def worker_stats(engine: LLMEngine, active_requests: int, num_queued: int = 0) -> WorkerStats:
    """`num_queued`: requests the worker holds outside the engine (waiting for blocks)."""
    usage, admission = engine.kv_usage, engine.admission
    stats = WorkerStats(
        active_requests=active_requests,
        active_tokens=engine.num_active_tokens,
        num_running=engine.num_batched,
        num_waiting=engine.num_waiting + num_queued,
        blocks_used=usage.used,
        blocks_cached=usage.cached,
        blocks_total=usage.total,
        blocks_leased=engine.num_held_blocks,
        prompt_tokens_computed=engine.num_prompt_tokens_computed,
        generation_tokens=engine.num_generated_tokens,
        prefix_cache_queried_tokens=admission.prefix_cache_queried_tokens,
        prefix_cache_hit_tokens=admission.prefix_cache_hit_tokens,
        num_admitted=admission.num_admitted,
        queue_seconds=admission.queue_seconds,
        spec_decode_num_drafts=engine.spec.num_drafts,
        spec_decode_num_draft_tokens=engine.spec.num_draft_tokens,
        spec_decode_num_accepted_tokens=engine.spec.num_accepted_tokens,
    )
    offload = engine.kv.offload
    if offload is not None:
        stats.kv_offload_host_blocks = len(offload.host)
        stats.kv_offload_disk_blocks = len(offload.disk) if offload.disk is not None else 0
        stats.kv_offload_stored_blocks = offload.num_offloaded_blocks
        stats.kv_offload_restored_blocks = offload.num_restored_blocks
        stats.kv_offload_disk_restored_blocks = offload.num_disk_restored_blocks
    return stats


def kv_events(engine: LLMEngine, worker_id: str) -> KVEvents | None:
    """The engine's new prefix-cache events, for the orchestrator (routing, /kv_cache_events)
    and the worker's PUB socket; None when there are none."""
    events = engine.take_kv_events()
    return KVEvents(worker_id=worker_id, events=events) if events else None


def kv_event_publisher(
    config: ClusterConfig, worker_id: str, context: zmq.Context
) -> KVEventPublisher | None:
    """The worker's vLLM-compatible KV-event PUB socket, when configured."""
    endpoint, replay = event_endpoints(config, worker_id)
    events = config.kv_cache.events
    if endpoint is None:
        return None
    return KVEventPublisher(context, endpoint, replay, events.topic, events.buffer_steps)
