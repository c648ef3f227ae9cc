"""What the orchestrator receives: requests and aborts from frontends (and aborts from postproc
workers, on a stop string), registration and heartbeats from every process, request endings and
KV events from engine workers, and the cluster queries of frontends and the CLI.

The orchestrator splits each GenerateRequest once, on arrival, into what each later hop reads
(`engine_request`, `postproc_start`). It forwards Abort to the workers that hold the request.
"""

from __future__ import annotations

import uuid
from typing import Literal

import msgspec

from common.block_hash import ExtraKey
from common.kv_events import KVEvent
from common.protocol.to_engine import EngineRequest, PromptImage, salt_extra_keys
from common.protocol.to_postproc import (
    PROMPT_CONTEXT_TOKENS,
    FinishReason,
    OutputOptions,
    PostprocStart,
)
from common.protocol.to_worker import KVPool
from common.protocol.wire import _Message, count_token_ids, tail_token_ids
from common.sampling_params import SamplingParams

Role = Literal["context", "generation", "postproc", "frontend"]


class GenerateRequest(_Message, tag="generate"):
    """A request as the frontend translated it: everything any later hop needs, once."""

    request_id: str
    prompt_token_ids_b64: str
    sampling: SamplingParams
    output: OutputOptions
    reply_to: str  # the frontend's PULL address for this request's chunks
    cache_salt: str | None = None
    priority: int = 0
    lora_name: str | None = None  # `model:` named a LoRA adapter (None: the base model)
    images: list[PromptImage] = msgspec.field(default_factory=list)  # in prompt order
    # the seed's conversation_params: the orchestrator keeps a conversation on its last workers
    conversation_id: str | None = None
    # Made by the frontend, where the tokens are, so that the orchestrator (the cluster's one
    # serial stage) never decodes a prompt: its length (load, the local-prefill threshold) and,
    # for the kv_aware router, its chained block hashes (common/block_hash.py)
    num_prompt_tokens: int = 0
    prompt_block_hashes: list[int] = msgspec.field(default_factory=list)

    @property
    def extra_keys(self) -> tuple[ExtraKey, ...]:
        return salt_extra_keys(self.cache_salt, self.lora_name, self.images)

    def engine_request(self) -> EngineRequest:
        """The part engine workers read (no output options, no routing fields)."""
        return EngineRequest(
            request_id=self.request_id,
            prompt_token_ids_b64=self.prompt_token_ids_b64,
            sampling=self.sampling,
            cache_salt=self.cache_salt,
            priority=self.priority,
            lora_name=self.lora_name,
            images=self.images,
        )

    def postproc_start(self) -> PostprocStart:
        """The part the postproc worker reads; the prompt only as far as the answer needs it.
        Nothing is decoded: the orchestrator, which makes it, never decodes a prompt."""
        output, prompt = self.output, self.prompt_token_ids_b64
        shows_prompt = output.return_token_ids or output.echo_prompt is not None
        return PostprocStart(
            request_id=self.request_id,
            reply_to=self.reply_to,
            output=output,
            n=self.sampling.n,
            logprobs=self.sampling.logprobs,
            min_tokens=self.sampling.min_tokens,
            num_prompt_tokens=count_token_ids(prompt),
            prompt_token_ids_b64=prompt if shows_prompt else "",
            prompt_tail_b64="" if shows_prompt else tail_token_ids(prompt, PROMPT_CONTEXT_TOKENS),
        )


class Abort(_Message, tag="abort"):
    request_id: str
    reason: Literal["client", "stop", "error", "shutdown"] = "client"


class Register(_Message, tag="register"):
    worker_id: str
    role: Role
    protocol_version: int
    pid: int
    # One per process start: a re-registration of the same process keeps its requests, another
    # process under the same id is a restart (or, while the first still heartbeats, refused).
    instance: str = msgspec.field(default_factory=lambda: uuid.uuid4().hex)
    address: str = ""  # the worker's own PULL address (postproc: where TokenBatches go)
    kv_pool: KVPool | None = None  # context workers: the pool generation workers read from
    num_blocks: int = 0  # engine workers: the size of the KV pool (TensorRT-LLM's created event)
    events_address: str = ""  # engine workers publishing KV events: the PUB endpoint


class PeersRequest(_Message, tag="peers_request"):
    """A generation worker was handed KV on a peer it does not know: send the peer set again."""

    worker_id: str


class Leaving(_Message, tag="leaving"):
    """A drained worker's last message: forget it now (no dead record, no timeout)."""

    worker_id: str


class WorkerStats(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Sent with each heartbeat: what /cluster_info, /metrics and the routers need. Totals count
    since the worker started."""

    active_requests: int = 0
    active_tokens: int = 0
    num_running: int = 0  # sequences in the engine's batch
    num_waiting: int = 0  # sequences queued in the engine (or decode requests waiting for blocks)
    blocks_used: int = 0
    blocks_cached: int = 0
    blocks_total: int = 0
    blocks_leased: int = 0
    prompt_tokens_computed: int = 0  # a pulled prompt is not recomputed
    generation_tokens: int = 0  # tokens sampled
    prefix_cache_queried_tokens: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hit_tokens: int = 0  # ... and found there
    kv_bytes_pulled: int = 0  # over NIXL
    kv_pull_seconds: float = 0.0
    kv_pull_failures: int = 0
    prompts_recomputed: int = 0  # handed-off prompts prefilled again here (KV gone, unreadable)
    num_admitted: int = 0  # requests admitted to the engine's batch ...
    queue_seconds: float = 0.0  # ... and the seconds they waited for it, in all
    # speculative decoding (vLLM's spec_decode counters): verification steps of a sequence with
    # proposals, the tokens proposed, and those accepted
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    # the KV offload tier (kv_cache.offload): blocks held in host memory and on disk now, blocks
    # copied there from the pool, copied back instead of recomputed (and of those, from disk),
    # and blocks read from peers' host tiers over NIXL (and reads that failed)
    kv_offload_host_blocks: int = 0
    kv_offload_disk_blocks: int = 0
    kv_offload_stored_blocks: int = 0
    kv_offload_restored_blocks: int = 0
    kv_offload_disk_restored_blocks: int = 0
    kv_offload_peer_blocks_read: int = 0
    kv_offload_peer_read_failures: int = 0


class Heartbeat(_Message, tag="heartbeat"):
    """From each worker's heartbeat thread, whatever its loop is doing (common/worker_link.py)."""

    worker_id: str
    stats: WorkerStats | None = None
    progress_age_s: float = 0.0  # since the worker's loop last finished a step
    peers_version: int = 0  # of the last Registered the worker applied


class RequestFinished(_Message, tag="finished"):
    """A generation worker is done with a request (all choices finished, or aborted)."""

    request_id: str
    worker_id: str
    finish_reason: FinishReason
    num_output_tokens: int = 0
    transfer_num_bytes: int = 0  # KV pulled over NIXL for this request
    transfer_seconds: float = 0.0


class KVEvents(_Message, tag="kv_events"):
    """A worker's prefix-cache changes since its last step (engine workers, when any)."""

    worker_id: str
    events: list[KVEvent]


class ClusterInfoRequest(_Message, tag="cluster_info_request"):
    pass


class DrainKVEvents(_Message, tag="drain_kv_events"):
    """Frontend → orchestrator: POST /kv_cache_events."""
