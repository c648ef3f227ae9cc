"""cluster.yaml as one typed, frozen tree, validated before anything starts.

Every key is declared here with its default; an unknown key, a wrong type or an out-of-range value
is rejected with the key's path (`kv_cache.block_size`) and the reason.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import msgspec

from common.builtin_models import builtin_model
from common.errors import validation_location
from common.parser_choice import ToolParserName

Positive = Annotated[int, msgspec.Meta(ge=1)]
# the weights' format, as vLLM's --quantization (engine/models/checkpoint.py QUANTIZATIONS)
Quantization = Literal["auto", "gguf", "compressed-tensors", "gptq", "awq", "dequantize"]
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
ZmqAddress = Annotated[str, msgspec.Meta(pattern=r"^(tcp|ipc|inproc)://.+")]


class _Section(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    pass


class FrontendConfig(_Section, frozen=True):
    host: str = "127.0.0.1"
    port: Port = 8000
    processes: Positive = (
        1  # several processes share the port, so one event loop is not the ceiling
    )
    api_key: str | None = None  # when set, every route but /health needs `Bearer <api_key>`
    max_body_bytes: Positive = 8 * 1024 * 1024  # larger request bodies get a 413
    allow_request_chat_template: bool = False  # may a request bring its own chat_template?
    # What an omitted temperature / top_p / top_k / min_p / repetition_penalty means: the model's
    # generation_config.json where it sets one (as vLLM), or always OpenAI's defaults.
    sampling_defaults: Literal["model", "openai"] = "model"
    # A request not finished this long after it arrived is aborted everywhere and answered with a
    # 504 (or, once streaming, a final error event): no request waits on a stuck part for good.
    request_timeout_seconds: Annotated[float, msgspec.Meta(gt=0)] = 600.0
    # Stored responses (POST /v1/responses with store: true): a SQLite file, one per host and
    # shared by its frontend processes, or redis://host:port/db for frontends on several hosts
    responses_store: str = "~/.cache/pdcluster/responses.sqlite3"
    # Anthropic Message Batches (kept in the same store): the requests of one batch in flight at
    # once, run by the frontend process that created it below interactive requests' priority
    batch_concurrency: Positive = 16
    # The seed's internal render / generate routes (frontend/render_routes.py): a separate
    # surface, for a router in front that wants prompt token ids; off unless asked for
    render_endpoints: bool = False


class OrchestratorConfig(_Section, frozen=True):
    address: ZmqAddress = "tcp://127.0.0.1:5550"  # what every process dials
    bind: ZmqAddress | None = None  # what the orchestrator binds, if not `address` (tcp://*:5550)
    router: Literal["round_robin", "least_loaded", "kv_aware"] = "kv_aware"
    max_local_prefill_length: Annotated[int, msgspec.Meta(ge=0)] = 0  # shorter prompts skip P/D
    # Load-aware prefill deflection (Dynamo's conditional disaggregation): once every context
    # worker holds this many prefills (running or queued), a new prompt is prefilled by a
    # generation worker instead, if one has fewer prompts waiting than the shortest context
    # queue. It pays where the context workers are the bottleneck and the generation workers'
    # steps have room, and costs throughput where the decode steps are (Qwen3-0.6B at 32
    # clients on the Xeon host: 47 against 54 tok/s, bench/README.md). "auto": a queue of
    # AUTO_PREFILL_QUEUE_SIZE, and only while prompts wait clearly longer for their first token
    # than they then take to decode, the context side the bottleneck
    # (orchestrator/stage_balance.py says why and how much longer); 0: never.
    max_prefill_queue_size: Annotated[int, msgspec.Meta(ge=0)] | Literal["auto"] = "auto"
    heartbeat_interval_seconds: Annotated[float, msgspec.Meta(gt=0)] = 0.5
    worker_timeout_seconds: Annotated[float, msgspec.Meta(gt=0)] = 5.0  # silent longer: dead
    # A live worker whose loop has not finished a step for this long is `stalled`: reported, kept,
    # and routed around. Heartbeats come from their own thread, so a long step is not death.
    stall_timeout_seconds: Annotated[float, msgspec.Meta(gt=0)] = 60.0
    max_requests: Positive = 4096  # in flight at once; beyond it a 429 with Retry-After
    # A draining worker (SIGTERM, `orchestrator drain`, `orchestrator scale` down) finishes its
    # requests for up to this long, then exits anyway and what it still holds fails.
    drain_timeout_seconds: Annotated[float, msgspec.Meta(gt=0)] = 60.0


# The token budget of one engine step (a prefill chunk plus the batch's decodes) where
# cluster.yaml leaves it out, by device: vLLM's CPU and GPU servers' 2048. Each chunk of one
# long prompt reads all the weights again: Qwen3-0.6B's 1,365-token prefill is 1.98 s in one
# step and 2.38 s in chunks of 512 (bench/README.md).
DEFAULT_MAX_NUM_BATCHED_TOKENS = {"cpu": 2048, "cuda": 2048}
# Where cluster.yaml leaves it out: a step starts prompt chunks only while it holds fewer tokens
# than this (engine/scheduler.py; the chunk that crosses it runs on, up to the budget above). A
# CPU's matmuls run nearly as fast at 512 rows as at 2048, so prompts that arrive together get
# their first tokens one after another instead of all at the end (SmolLM2, 8 prompts of 128-256
# tokens at once, float32: TTFT p50 2.3 s against 3.2-3.8, all done in the same time). None:
# the budget (a GPU's matmuls are faster the more rows they have).
DEFAULT_STEP_FILL_TOKENS = {"cpu": 512, "cuda": None}


class _EngineWorkersConfig(_Section, frozen=True):
    count: Positive = 1
    max_num_seqs: Positive = 64
    max_num_batched_tokens: Positive | None = None  # None: DEFAULT_MAX_NUM_BATCHED_TOKENS
    step_fill_tokens: Positive | None = None  # None: DEFAULT_STEP_FILL_TOKENS


class ContextWorkersConfig(_EngineWorkersConfig, frozen=True):
    pass


class GenerationWorkersConfig(_EngineWorkersConfig, frozen=True):
    pass


class PostprocWorkersConfig(_Section, frozen=True):
    count: Positive = 2


class KVEventsConfig(_Section, frozen=True):
    """vLLM-compatible KV-event publishing. On loopback, engine worker k (generation workers
    first, then context workers) binds the endpoint's port + k, and its replay socket
    replay_zmq's port + k; on any other address (a pod each) all bind the given ports."""

    zmq: ZmqAddress | None = None  # PUB endpoint base, e.g. tcp://127.0.0.1:5557
    replay_zmq: ZmqAddress | None = None  # replay ROUTER endpoint base
    topic: str = ""
    buffer_steps: Positive = 10_000  # batches kept for replay


class KVOffloadConfig(_Section, frozen=True):
    """The KV offload tier (engine/kv_offload.py): blocks the pool evicts from its prefix cache
    are kept in host memory (host_bytes, LRU) and, behind it, in files under disk_path (disk_bytes,
    LRU), and copied back on a later prefix hit instead of being recomputed. host_bytes 0: off."""

    host_bytes: Annotated[int, msgspec.Meta(ge=0)] = 0
    disk_path: str | None = None  # a directory; each worker writes its own subdirectory
    disk_bytes: Annotated[int, msgspec.Meta(ge=0)] = 0

    @property
    def enabled(self) -> bool:
        return self.host_bytes > 0


class KVCacheConfig(_Section, frozen=True):
    block_size: Annotated[int, msgspec.Meta(ge=1, le=256)] = 16
    num_blocks: Positive = 2048
    prefix_caching: bool = True
    # auto: the model's dtype; bfloat16; int8 (a scale per row, engine/kernels/kv_quant.py)
    dtype: Literal["auto", "bfloat16", "int8"] = "auto"
    events: KVEventsConfig = KVEventsConfig()
    offload: KVOffloadConfig = KVOffloadConfig()


class SpeculativeConfig(_Section, frozen=True):
    """Speculative decoding on the engines that decode (vLLM's --speculative-config): each step
    proposes up to num_speculative_tokens tokens per sequence, which one forward verifies."""

    # ngram: prompt lookup, the last n tokens (prompt_lookup_max down to prompt_lookup_min) found
    # earlier in the sequence propose what followed them there; no draft model.
    # draft_model: `model`, a smaller model of the same tokenizer, proposes its greedy tokens
    method: Literal["ngram", "draft_model"] = "ngram"
    model: str | None = None  # the draft model (a directory, a builtin, a hub id in the cache)
    quantization: Quantization = "auto"  # the draft's, as the cluster's `quantization`
    num_speculative_tokens: Annotated[int, msgspec.Meta(ge=1, le=32)] = 4
    prompt_lookup_min: Positive = 1
    prompt_lookup_max: Positive = 4
    # vLLM v0's: no proposals in a step whose batch has at least this many sequences (where the
    # cores are busy already, verifying proposals costs more than it saves); None: always
    disable_by_batch_size: Positive | None = None

    def __post_init__(self) -> None:
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative.model names the draft model: required with method "
                             "draft_model, and only with it")  # fmt: skip
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max "
                f"({self.prompt_lookup_max})"
            )


class LoRAConfig(_Section, frozen=True):
    """Multi-LoRA (vLLM's --enable-lora, --lora-modules, --max-loras, --max-lora-rank): PEFT
    adapters served beside the base model, each requested as `model: <name>`."""

    # name -> PEFT directory (adapter_config.json + adapter_model.safetensors), loaded at start
    # on every engine worker; POST /v1/load_lora_adapter adds more at run time
    adapters: dict[str, str] = msgspec.field(default_factory=dict)
    max_loras: Positive = 4  # adapters loaded at once, each in a resident slot of every layer
    max_lora_rank: Positive = 16  # the largest rank r an adapter may have

    def __post_init__(self) -> None:
        if len(self.adapters) > self.max_loras:
            raise ValueError(f"{len(self.adapters)} adapters but max_loras is {self.max_loras}")


class TransferConfig(_Section, frozen=True):
    backend: Literal["nixl"] = "nixl"
    lease_seconds: Annotated[float, msgspec.Meta(gt=0)] = 30.0  # context side frees after this
    pull_timeout_seconds: Annotated[float, msgspec.Meta(gt=0)] = 10.0  # generation side gives up
    # A failed READ (its source died or is unreachable): prefill the prompt on the generation
    # worker, as vLLM's "recompute" KV-load failure policy; false: fail the request (503).
    recompute_on_failure: bool = True

    def __post_init__(self) -> None:
        # The reader must give up (and cancel its READ) before the source frees the blocks.
        if self.pull_timeout_seconds >= self.lease_seconds:
            raise ValueError(
                f"pull_timeout_seconds ({self.pull_timeout_seconds}) must be shorter than "
                f"lease_seconds ({self.lease_seconds})"
            )


class SecurityConfig(_Section, frozen=True):
    """ZeroMQ CURVE on every internal socket (common/curve.py)."""

    curve: bool = True  # off only to debug on a trusted host: then any local process can join
    # cluster.key + cluster.key_secret (a Kubernetes Secret); None: `orchestrator up` makes a
    # new pair for each run, in a private directory
    keys_dir: str | None = None


class ProfilerConfig(_Section, frozen=True):
    """POST /start_profile and /stop_profile (engine/profiling.py)."""

    # each engine worker's torch profiler trace and op table are written here, on its own host;
    # None: profiling is off and the routes are 404s
    dir: str | None = None
    # a session records at most this many engine steps: ending it holds the GIL ~10 ms a step
    # (engine/profiling.py), and a worker silent for worker_timeout_seconds is declared dead
    max_steps: Positive = 100


class CpuConfig(_Section, frozen=True):
    """Engine workers' compute threads on a CPU host (engine/cpu_placement.py)."""

    # torch threads per engine worker; 0: the host's cores less one, shared out among its engines
    threads_per_engine: Annotated[int, msgspec.Meta(ge=0)] = 0
    pin: bool = True  # each engine worker on its own cores (none shared with another engine)


class ClusterConfig(_Section, frozen=True):
    # a builtin (common/builtin_models.py), a Hugging Face directory, or a hub id org/name or
    # org/name@revision served from the Hugging Face cache (common/hub_models.py)
    model: str = "builtin:smollm2-135m"
    mode: Literal["disaggregated", "aggregated"] = "disaggregated"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # the weights' format, as vLLM's --quantization: auto (what the checkpoint holds: a GGUF's
    # blocks, a quantization_config's); a format's name also checks the checkpoint holds it;
    # dequantize serves quantized weights as float ones in `dtype`
    quantization: Quantization = "auto"
    device: Literal["cpu", "cuda"] = "cpu"
    internal_host: str = "127.0.0.1"  # where workers and frontends bind their own PULL sockets
    advertise_host: str | None = None  # the host peers dial for those (a pod IP); internal_host
    # [low, high]: every port the cluster's processes pick for themselves (workers' and frontends'
    # PULL sockets, UCX listeners) is taken from here; None: any free port
    port_range: tuple[Port, Port] | None = None
    tool_parser: ToolParserName | None = None  # None: the builtin's, else by config.json model_type
    # the longest prompt + output served (vLLM's --max-model-len); None: the model's
    # max_position_embeddings, capped at what the KV cache holds (context_length below)
    max_model_len: Positive | None = None

    frontend: FrontendConfig = FrontendConfig()
    orchestrator: OrchestratorConfig = OrchestratorConfig()
    context_workers: ContextWorkersConfig = ContextWorkersConfig()
    generation_workers: GenerationWorkersConfig = GenerationWorkersConfig()
    postproc_workers: PostprocWorkersConfig = PostprocWorkersConfig()
    kv_cache: KVCacheConfig = KVCacheConfig()
    speculative: SpeculativeConfig | None = None  # off unless given
    lora: LoRAConfig | None = None  # off unless given
    transfer: TransferConfig = TransferConfig()
    security: SecurityConfig = SecurityConfig()
    cpu: CpuConfig = CpuConfig()
    profiler: ProfilerConfig = ProfilerConfig()

    def __post_init__(self) -> None:
        builtin_model(self.model)  # an unknown builtin:... name is a ValueError naming them all
        if self.port_range is not None and not self.port_range[0] < self.port_range[1]:
            raise ValueError(f"port_range must be [low, high] with low < high: {self.port_range}")
        for name in ("context_workers", "generation_workers"):
            workers = getattr(self, name)
            budget = workers.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS[self.device]
            if workers.step_fill_tokens is not None and workers.step_fill_tokens > budget:
                raise ValueError(f"{name}.step_fill_tokens ({workers.step_fill_tokens}) is more "
                                 f"than its max_num_batched_tokens ({budget})")  # fmt: skip


def context_length(
    model_max: int, requested: int | None, num_blocks: int, block_size: int
) -> tuple[int, str | None]:
    """(the context length a cluster serves, why it is shorter than the model's, or None).

    Asked for (cluster.yaml `max_model_len`, `LLM(max_model_len=)`): that, which must fit the
    model's positions and the KV cache (a longer request could never run), else a ValueError.
    Not asked for: the model's length, capped at the cache's tokens, as SGLang does (vLLM refuses
    to start instead): a 131k-position model on a 32k-token cache serves 32k-token requests,
    where a request leaving max_tokens out would otherwise ask for all 131k and be refused."""
    capacity = num_blocks * block_size
    if requested is not None:
        if requested > model_max:
            raise ValueError(
                f"max_model_len {requested} exceeds the model's max_position_embeddings {model_max}"
            )
        if requested > capacity:
            raise ValueError(
                f"max_model_len {requested} exceeds the KV cache's {capacity} tokens "
                f"({num_blocks} blocks of {block_size}): raise kv_cache.num_blocks"
            )
        return requested, None
    if model_max > capacity:
        return capacity, (
            f"context length {capacity} tokens (the KV cache's {num_blocks} blocks of "
            f"{block_size}), not the model's {model_max}: raise kv_cache.num_blocks for more"
        )
    return model_max, None


class ConfigError(ValueError):
    """cluster.yaml is unreadable or invalid; the message names the file, the key and the reason."""


def load_cluster_config(path: str | Path) -> ClusterConfig:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    return parse_cluster_config(text, source=str(path))


def parse_cluster_config(text: str, source: str = "cluster.yaml") -> ClusterConfig:
    """A file with no mapping at all (empty, only comments, a bare `---`) means every default."""
    try:
        if msgspec.yaml.decode(text or "{}") is None:
            return ClusterConfig()
        return msgspec.yaml.decode(text or "{}", type=ClusterConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{source}: {_readable(str(exc))}") from None
    except msgspec.DecodeError as exc:
        raise ConfigError(f"{source}: not valid YAML: {exc}") from None


def _readable(message: str) -> str:
    """Lead with the key: 'kv_cache.block_size: Expected `int` >= 1'."""
    reason, path = validation_location(message)
    return f"{path}: {reason}" if path else reason
