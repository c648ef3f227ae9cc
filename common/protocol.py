"""Every message that crosses a process boundary, as tagged msgspec Structs encoded to msgpack.

    frontend ──GenerateRequest / Abort──────────────▶ orchestrator (ROUTER)
    frontend, CLI ──ClusterInfoRequest──────────────▶ orchestrator ──ClusterInfo──▶ asker
    frontend ──DrainKVEvents────────────────────────▶ orchestrator ──KVEventsDrained──▶ frontend
    frontend ──Profile──▶ orchestrator ──Profile──▶ every engine worker ──ProfileDone──▶
        orchestrator ──ProfileDone (all answers merged)──▶ frontend
    context / generation worker ──KVEvents──────────▶ orchestrator (kv_aware router, event queue)
    orchestrator ──RequestFailed────────────────────▶ frontend
    worker ──Register / Heartbeat───────────────────▶ orchestrator ──Registered / Refused──▶ worker
    generation worker ──PeersRequest────────────────▶ orchestrator ──Registered──▶ that worker
    orchestrator ──RegisterAgain────────────────────▶ worker it does not know (it restarted)
    worker (SIGTERM), CLI ──Drain───────────────────▶ orchestrator ──Drain (in_flight)──▶ worker
    drained worker ──Leaving────────────────────────▶ orchestrator (forgets it; it exits 0)
    orchestrator ──PrefillRequest / Abort───────────▶ context worker (EngineRequest + packed
                                                      PostprocStart: the GenerateRequest split)
    context worker ──PrefillDone / RequestFailed────▶ orchestrator
    orchestrator ──DecodeRequest / Abort────────────▶ generation worker
    generation worker ══NIXL READ (KV blocks)═══════▶ context worker (notification frees its lease)
    generation worker ──RequestFinished / Failed────▶ orchestrator
    generation worker ──TokenBatch (PUSH)───────────▶ postproc worker (PULL), by request id; a
                                                      request's first brings its PostprocStart
    context worker ──TokenBatch (PUSH)──────────────▶ postproc worker, only when the first token
                                                      ends the request (no generation worker)
    postproc worker ──Abort(reason="stop")──────────▶ orchestrator
    postproc worker ──Chunk (PUSH)──────────────────▶ frontend (PULL at PostprocStart.reply_to)

Bulk data never rides ZMQ: KV moves over NIXL, prompts travel once as base64 int32, tokens as
deltas. Each hop carries what its receiver reads: the orchestrator splits a GenerateRequest once
into the EngineRequest (prompt, sampling) and the PostprocStart (output options, reply address,
the prompt only when the answer shows it), which engines forward packed, unread.
"""

from __future__ import annotations

import base64
import uuid
from typing import Literal

import msgspec
import numpy as np

from common.block_hash import ExtraKey
from common.kv_events import KVEvent
from common.parser_choice import ParserState
from common.responses_schema import ResponseSettings
from common.sampling_params import SamplingParams
from common.stage_times import StageTimes

PROTOCOL_VERSION = 7  # 7: finish reasons typed (FinishReason)

Role = Literal["context", "generation", "postproc", "frontend"]

# Why a choice ended: the engine's own reasons ("stop": a stop token or EOS, "length":
# max_tokens or the context, "abort": aborted), and FAILED, a request that failed (the error
# reaches the frontend from the orchestrator). Decoding rejects any other value.
FinishReason = Literal["stop", "length", "abort", "error"]


class _Message(msgspec.Struct, tag_field="type", omit_defaults=True, kw_only=True):
    pass


def encode_token_ids(token_ids: list[int]) -> str:
    """Prompt token ids as base64 of little-endian int32: compact, and never a JSON list."""
    return base64.b64encode(np.asarray(token_ids, dtype="<i4").tobytes()).decode("ascii")


def decode_token_ids(b64: str) -> list[int]:
    raw = base64.b64decode(b64, validate=True)
    if len(raw) % 4:
        raise ValueError("prompt_token_ids_b64 must hold a whole number of int32 values")
    return [int(i) for i in np.frombuffer(raw, dtype="<i4")]


def count_token_ids(b64: str) -> int:
    """How many token ids `b64` holds, read from its length (nothing decoded)."""
    padding = len(b64) - len(b64.rstrip("="))
    return (len(b64) * 3 // 4 - padding) // 4


def tail_token_ids(b64: str, num_tokens: int) -> str:
    """The last `num_tokens` token ids of `b64` (up to two more), still encoded, cut without
    decoding: three int32 are 12 bytes, 16 base64 characters, so a cut at a multiple of three
    tokens keeps whole base64 groups.

        ids     | t0 t1 t2 | t3 t4 t5 | t6 t7 ... |
        base64  | 16 chars | 16 chars | 16 ...    |   cut here ─▶ a valid encoding of t3...
    """
    start = max(0, count_token_ids(b64) - num_tokens) // 3
    return b64[start * 16 :]


class OutputOptions(msgspec.Struct, omit_defaults=True, kw_only=True):
    """How the postproc worker turns this request's tokens into OpenAI (or Anthropic) bytes."""

    kind: Literal["completion", "chat", "anthropic", "responses", "embedding"] = "completion"
    model: str = ""
    created: int = 0
    stream: bool = False
    include_usage: bool = False
    response_id: str = ""  # the id the client sees, when it is not the request id (prompt lists)
    index_offset: int = 0  # added to choice indexes: prompt i of a list starts at i * n
    echo_prompt: str | None = None  # completion echo: the prompt text to prepend
    stop: list[str] = msgspec.field(default_factory=list)
    skip_special_tokens: bool = True
    echo_only: bool = False  # max_tokens 0 with echo: the one token sampled is not output
    # best_of > n: the engine samples best_of choices (with log-probs, to rank them); the answer
    # holds the `keep_best` with the highest cumulative log-prob, and `output_logprobs` (the
    # client's own `logprobs`, None: none) decides what is shown. 0: every choice, as sampled.
    keep_best: int = 0
    output_logprobs: int | None = None
    responses: ResponseSettings | None = None  # kind "responses": the settings it echoes
    embedding_base64: bool = False  # kind "embedding": base64 of float32 LE, else a float list
    parser_state: ParserState | None = None  # chat-like kinds: the reasoning / tool parsers
    # Prompt tokens not billed in usage: a forced tool call's prefix the frontend appended after
    # the template (the seed's prompt_tokens_excluded_from_usage)
    prompt_tokens_excluded: int = 0
    return_token_ids: bool = False  # prompt and output token ids in the body / chunks (vLLM's)
    perf_metrics: bool = False  # the request's StageTimes in the body / last chunk


def salt_extra_keys(cache_salt: str | None) -> tuple[ExtraKey, ...]:
    """What salts a request's block hashes: a cache_salt keeps tenants' prefixes apart. Engine
    workers and the orchestrator's router must hash alike, so both read it here."""
    return (("cache_salt", cache_salt),) if cache_salt else ()


class EngineRequest(msgspec.Struct, omit_defaults=True, kw_only=True):
    """What an engine worker (context or generation) reads of a request: its prompt and how to
    sample it. Made by the orchestrator from the GenerateRequest (`engine_request`)."""

    request_id: str
    prompt_token_ids_b64: str
    sampling: SamplingParams
    cache_salt: str | None = None
    priority: int = 0

    @property
    def extra_keys(self) -> tuple[ExtraKey, ...]:
        return salt_extra_keys(self.cache_salt)


# Prompt tokens the postproc worker's detokenizer keeps as left context for a choice's first
# output tokens (SentencePiece drops a word-initial space at the start of a decode).
PROMPT_CONTEXT_TOKENS = 5


class PostprocStart(msgspec.Struct, omit_defaults=True, kw_only=True):
    """What the postproc worker reads of a request: how to render it, where to send it, and
    the few sampling settings that shape the answer. Made by the orchestrator from the
    GenerateRequest (`postproc_start`) and packed once (`pack_postproc_start`): engines forward
    it on the request's first TokenBatch without decoding it, since they read none of it."""

    request_id: str
    reply_to: str  # the frontend's PULL address for this request's chunks
    output: OutputOptions
    n: int = 1  # choices (SamplingParams.n)
    logprobs: int | None = None  # SamplingParams.logprobs: recorded, to show or to rank
    min_tokens: int = 0  # SamplingParams.min_tokens: stop strings are ignored before this many
    num_prompt_tokens: int = 0
    # The whole prompt, only when the answer shows it (return_token_ids, completion echo);
    # otherwise its last PROMPT_CONTEXT_TOKENS or so, the detokenizer's left context
    prompt_token_ids_b64: str = ""
    prompt_tail_b64: str = ""


_start_encoder = msgspec.msgpack.Encoder()
_start_decoder = msgspec.msgpack.Decoder(PostprocStart)


def pack_postproc_start(start: PostprocStart) -> msgspec.Raw:
    return msgspec.Raw(_start_encoder.encode(start))


def unpack_postproc_start(packed: msgspec.Raw) -> PostprocStart:
    """Raises msgspec.DecodeError / ValidationError on a malformed start."""
    return _start_decoder.decode(packed)


class GenerateRequest(_Message, tag="generate"):
    request_id: str
    prompt_token_ids_b64: str
    sampling: SamplingParams
    output: OutputOptions
    reply_to: str  # the frontend's PULL address for this request's chunks
    cache_salt: str | None = None
    priority: int = 0
    # Made by the frontend, where the tokens are, so that the orchestrator (the cluster's one
    # serial stage) never decodes a prompt: its length (load, the local-prefill threshold) and,
    # for the kv_aware router, its chained block hashes (common/block_hash.py)
    num_prompt_tokens: int = 0
    prompt_block_hashes: list[int] = msgspec.field(default_factory=list)

    @property
    def extra_keys(self) -> tuple[ExtraKey, ...]:
        return salt_extra_keys(self.cache_salt)

    def engine_request(self) -> EngineRequest:
        """The part engine workers read (no output options, no routing fields)."""
        return EngineRequest(
            request_id=self.request_id,
            prompt_token_ids_b64=self.prompt_token_ids_b64,
            sampling=self.sampling,
            cache_salt=self.cache_salt,
            priority=self.priority,
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


class RequestFailed(_Message, tag="failed"):
    """A request ended before or instead of its output; the frontend turns it into an HTTP error.

    Workers send it to the orchestrator (which ends the request and forwards it to the frontend).
    `param` names the offending request field for 400s.
    """

    request_id: str
    status_code: int
    message: str
    code: str = "internal_error"
    param: str | None = None


class KVPool(msgspec.Struct, frozen=True, kw_only=True):
    """A worker's NIXL-registered KV pool, exchanged once at registration."""

    agent_name: str
    agent_metadata: bytes
    base_address: int
    num_blocks: int
    block_num_bytes: int
    device_id: int = 0
    memory_kind: str = "DRAM"


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


class Registered(_Message, tag="registered"):
    """Sent to a worker on registration, and to generation workers whenever the set of live
    context workers changes, or a heartbeat shows an older `peers_version` than the current one
    (so a lost update, or a worker that was out of touch, converges): everyone it must know."""

    peers: list[KVPool] = msgspec.field(default_factory=list)  # live context workers' pools
    peers_version: int = 0  # increases with each change of `peers`


class PeersRequest(_Message, tag="peers_request"):
    """A generation worker was handed KV on a peer it does not know: send the peer set again."""

    worker_id: str


class Refused(_Message, tag="refused"):
    """Registration refused (protocol version, duplicate id): the worker logs it and exits."""

    reason: str


class RegisterAgain(_Message, tag="register_again"):
    """A heartbeat came from a worker the orchestrator does not know (the orchestrator
    restarted)."""


class Drain(_Message, tag="drain"):
    """Take `worker_id` out of service without failing anything: no new work goes to it, what
    it holds finishes, then it leaves and exits 0.

    To the orchestrator (from the worker itself on SIGTERM, or from `orchestrator drain`): mark
    it draining. To the worker (on marking, and whenever the count changes): nothing new will
    follow this message, and `in_flight` requests in the orchestrator's table still pass through
    it (a postproc worker's may not have reached it yet); it may go once that is 0 and it holds
    nothing itself (requests, KV leases, pulls)."""

    worker_id: str
    in_flight: int = 0


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


class Heartbeat(_Message, tag="heartbeat"):
    """From each worker's heartbeat thread, whatever its loop is doing (common/worker_link.py)."""

    worker_id: str
    stats: WorkerStats | None = None
    progress_age_s: float = 0.0  # since the worker's loop last finished a step
    peers_version: int = 0  # of the last Registered the worker applied


# TokenDelta.finish_reason of a request that failed: its postproc worker drops it and sends the
# frontend nothing, since the frontend hears of the failure (the error to answer) from the
# orchestrator.
FAILED: FinishReason = "error"


class TokenDelta(msgspec.Struct, array_like=True, omit_defaults=True):
    """New tokens of one choice of one request, from one engine step."""

    request_id: str
    index: int
    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # SamplingParams.prompt_logprobs, with choice 0's first token: (log-prob, top alternatives)
    # of prompt tokens 1, 2, ... given the ones before
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    embedding: bytes | None = None  # SamplingParams.embed: the pooled vector, float32 LE
    # On a choice's first token, the stages up to it; on its last, every stage
    times: StageTimes | None = None
    # A beam search's prompt, prefilled by a context worker (no token): its best continuations,
    # (token id, log-prob), from which the generation worker starts the beams
    beam_candidates: list[tuple[int, float]] | None = None


class PrefillRequest(_Message, tag="prefill"):
    request: EngineRequest
    postproc_address: str
    # A packed PostprocStart, forwarded to the postproc worker only if the first tokens end
    # the request (else the DecodeRequest brings it to the generation worker)
    postproc_start: msgspec.Raw


class PrefillDone(_Message, tag="prefill_done"):
    """The context worker's answer: each choice's first token, and the leased blocks (of choice 0)
    that hold the prompt's KV, readable through NIXL agent `agent_name`.

    When every choice already finished with its first token, `block_ids` is empty, nothing is
    leased, and the context worker has sent the tokens to the postproc worker itself.
    """

    request_id: str
    worker_id: str
    agent_name: str
    first: list[TokenDelta]  # one per choice, index order
    block_ids: list[int] = msgspec.field(default_factory=list)
    # How long the blocks stay leased, counted from when this was sent: a duration, since the
    # context and generation workers' clocks need not agree (the orchestrator forwards at once;
    # the reader counts it from a moment before this reached it: generation_worker/arrival.py).
    # 0: nothing leased.
    lease_s: float = 0.0
    # the stages up to the first token
    times: StageTimes = msgspec.field(default_factory=StageTimes)

    @property
    def finished(self) -> bool:
        return all(d.finish_reason is not None for d in self.first)


class DecodeRequest(_Message, tag="decode"):
    request: EngineRequest
    postproc_address: str
    postproc_start: msgspec.Raw  # a packed PostprocStart, forwarded with the first tokens
    prefill: PrefillDone | None = None  # None: the generation worker prefills itself


class RequestFinished(_Message, tag="finished"):
    """A generation worker is done with a request (all choices finished, or aborted)."""

    request_id: str
    worker_id: str
    finish_reason: FinishReason
    num_output_tokens: int = 0
    transfer_num_bytes: int = 0  # KV pulled over NIXL for this request
    transfer_seconds: float = 0.0


class ClusterInfoRequest(_Message, tag="cluster_info_request"):
    pass


class WorkerInfo(WorkerStats, omit_defaults=False, kw_only=True):
    """One row of `orchestrator status` and GET /cluster_info: who, where, and its last stats."""

    worker_id: str
    role: str  # orchestrator | context | generation | postproc | frontend
    pid: int
    address: str
    state: str  # ready | stalled (alive, its loop not progressing) | draining | dead
    progress_age_s: float = 0.0  # since its loop last finished a step
    events_address: str = ""  # its KV-event PUB socket, if it publishes
    last_heartbeat_s: float = 0.0  # seconds since the last heartbeat


class KVEvents(_Message, tag="kv_events"):
    """A worker's prefix-cache changes since its last step (engine workers, when any)."""

    worker_id: str
    events: list[KVEvent]


class DrainKVEvents(_Message, tag="drain_kv_events"):
    """Frontend → orchestrator: POST /kv_cache_events."""


class KVEventsDrained(_Message, tag="kv_events_drained"):
    events_json: bytes  # a JSON array in TensorRT-LLM's shape


class ClusterInfo(_Message, tag="cluster_info"):
    workers: list[WorkerInfo]
    num_requests: int = 0  # requests the orchestrator is tracking


# The orchestrator's wait for every worker's answer: a stop answers once the trace and table are
# written, which takes about a minute per 1000 steps recorded (engine/profiling.py)
PROFILE_ANSWER_TIMEOUT_S = 600.0


class Profile(_Message, tag="profile"):
    """POST /start_profile or /stop_profile: the torch profiler around every engine worker's
    steps (engine/profiling.py)."""

    action: Literal["start", "stop"]


class ProfileDone(_Message, tag="profile_done"):
    """One engine worker's answer to a Profile, or (orchestrator → frontend) all of them."""

    action: Literal["start", "stop"]
    workers: list[str] = msgspec.field(default_factory=list)  # the workers that did it
    files: list[str] = msgspec.field(default_factory=list)  # traces and tables written (stop)
    errors: list[str] = msgspec.field(default_factory=list)  # "<worker id>: <why>"


class TokenBatch(_Message, tag="tokens"):
    deltas: list[TokenDelta]
    # the packed PostprocStart of each request new to this postproc worker, as it came
    starts: list[msgspec.Raw] = msgspec.field(default_factory=list)


class Chunk(_Message, tag="chunk"):
    """Bytes ready for the client: SSE frames when streaming, the whole JSON body otherwise.
    A `status_code` other than 200 makes `data` an error body and ends the request."""

    request_id: str
    data: bytes
    done: bool = False
    status_code: int = 200
    prompt_tokens: int = 0  # on the ending chunk: the request's usage, for the frontend's metrics
    completion_tokens: int = 0
    times: StageTimes | None = None  # on the ending chunk: for the Server-Timing header


Message = (
    GenerateRequest
    | Abort
    | RequestFailed
    | Register
    | Registered
    | Refused
    | RegisterAgain
    | Drain
    | Leaving
    | Heartbeat
    | PeersRequest
    | PrefillRequest
    | PrefillDone
    | DecodeRequest
    | RequestFinished
    | TokenBatch
    | Chunk
    | ClusterInfoRequest
    | ClusterInfo
    | KVEvents
    | DrainKVEvents
    | KVEventsDrained
    | Profile
    | ProfileDone
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes) -> Message:
    """Raises msgspec.DecodeError / ValidationError on malformed or unknown messages."""
    return _decoder.decode(data)
