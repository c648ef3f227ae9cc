"""GET /metrics: the frontend processes' request metrics (prometheus_client multiprocess mode:
every frontend process on the port writes to one directory, any of them answers the scrape) plus
the cluster's per-worker figures, read from the orchestrator's table at scrape time.

Import this module only after PROMETHEUS_MULTIPROC_DIR is set (frontend/main.py does it).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
    multiprocess,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from common.protocol import ClusterInfo, WorkerInfo
from common.stage_times import StageTimes

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)

REQUESTS = Counter(
    "pdcluster_requests", "Requests answered, by route and status", ["route", "status"]
)
TIME_TO_FIRST_TOKEN = Histogram(
    "pdcluster_time_to_first_token_seconds",
    "From the request's arrival to its first token (or whole answer) coming back",
    buckets=LATENCY_BUCKETS,
)
INTER_TOKEN_LATENCY = Histogram(
    "pdcluster_inter_token_latency_seconds",
    "Mean time between output tokens of a streamed request",
    buckets=TOKEN_LATENCY_BUCKETS,
)
E2E_LATENCY = Histogram(
    "pdcluster_e2e_request_latency_seconds",
    "From the request's arrival to its last byte",
    buckets=LATENCY_BUCKETS,
)
REQUEST_STAGES = Histogram(
    "pdcluster_request_stage_seconds",
    "Where finished requests' time went, as the workers measured it (common/stage_times.py)",
    ["stage"],
    buckets=LATENCY_BUCKETS,
)
PROMPT_TOKENS = Counter("pdcluster_prompt_tokens", "Prompt tokens of finished requests")
GENERATION_TOKENS = Counter("pdcluster_generation_tokens", "Output tokens of finished requests")


def observe_generation(
    ttft_s: float,
    e2e_s: float,
    prompt_tokens: int,
    completion_tokens: int,
    streamed: bool,
    times: StageTimes | None = None,
) -> None:
    """One finished generation (a response fully sent)."""
    E2E_LATENCY.observe(e2e_s)
    if times is not None:
        for field in times.__struct_fields__:
            REQUEST_STAGES.labels(field.removesuffix("_s")).observe(getattr(times, field))
    TIME_TO_FIRST_TOKEN.observe(ttft_s)
    if streamed and completion_tokens > 1:
        INTER_TOKEN_LATENCY.observe((e2e_s - ttft_s) / (completion_tokens - 1))
    PROMPT_TOKENS.inc(prompt_tokens)
    GENERATION_TOKENS.inc(completion_tokens)


# (kind, name, help, value of a worker or None when the family does not apply to it)
_G, _C = GaugeMetricFamily, CounterMetricFamily
WORKER_FAMILIES: list[tuple[type, str, str, Callable[[WorkerInfo], float | None]]] = [
    (
        _G,
        "pdcluster_worker_up",
        "1 while the worker heartbeats (ready or stalled)",
        lambda w: float(w.state != "dead"),
    ),
    (
        _G,
        "pdcluster_worker_stalled",
        "1 while the worker heartbeats but its loop has not finished a step for the stall limit",
        lambda w: float(w.state == "stalled"),
    ),
    (
        _G,
        "pdcluster_worker_progress_age_seconds",
        "Seconds since the worker's loop last finished a step",
        lambda w: w.progress_age_s,
    ),
    (
        _G,
        "pdcluster_num_requests_running",
        "Sequences in the batch",
        lambda w: _engine(w, w.num_running),
    ),
    (
        _G,
        "pdcluster_num_requests_waiting",
        "Sequences waiting",
        lambda w: _engine(w, w.num_waiting),
    ),
    (
        _G,
        "pdcluster_kv_blocks_used",
        "KV blocks held by requests",
        lambda w: _engine(w, w.blocks_used),
    ),
    (
        _G,
        "pdcluster_kv_blocks_cached",
        "Unreferenced prefix-cache blocks",
        lambda w: _engine(w, w.blocks_cached),
    ),
    (
        _G,
        "pdcluster_kv_blocks_leased",
        "KV blocks leased to a reader",
        lambda w: _engine(w, w.blocks_leased),
    ),
    (
        _G,
        "pdcluster_kv_blocks_total",
        "KV blocks in the pool",
        lambda w: _engine(w, w.blocks_total),
    ),
    (
        _G,
        "pdcluster_prefix_cache_hit_rate",
        "Prompt tokens found in the prefix cache",
        lambda w: _hit_rate(w),
    ),
    (
        _C,
        "pdcluster_prefix_cache_hit_tokens",
        "Prompt tokens from the prefix cache",
        lambda w: _engine(w, w.prefix_cache_hit_tokens),
    ),
    (
        _C,
        "pdcluster_prefill_tokens",
        "Prompt tokens run through the model",
        lambda w: _engine(w, w.prompt_tokens_computed),
    ),
    (_C, "pdcluster_decode_tokens", "Tokens sampled", lambda w: _engine(w, w.generation_tokens)),
    (
        _C,
        "pdcluster_local_prefills",
        "Prompts sent to this generation worker to prefill itself (aggregated mode, a short "
        "prompt, no context worker up, or the context workers' queues full)",
        lambda w: _gen(w, w.local_prefills_routed),
    ),
    (
        _C,
        "pdcluster_spec_decode_num_drafts",
        "Speculative verification steps (a sequence with proposals, one step)",
        lambda w: _engine(w, w.spec_decode_num_drafts),
    ),
    (
        _C,
        "pdcluster_spec_decode_num_draft_tokens",
        "Speculative tokens proposed",
        lambda w: _engine(w, w.spec_decode_num_draft_tokens),
    ),
    (
        _C,
        "pdcluster_spec_decode_num_accepted_tokens",
        "Speculative tokens accepted",
        lambda w: _engine(w, w.spec_decode_num_accepted_tokens),
    ),
    (
        _G,
        "pdcluster_kv_offload_host_blocks",
        "KV blocks in the host-memory offload tier",
        lambda w: _engine(w, w.kv_offload_host_blocks),
    ),
    (
        _G,
        "pdcluster_kv_offload_disk_blocks",
        "KV blocks in the disk offload tier",
        lambda w: _engine(w, w.kv_offload_disk_blocks),
    ),
    (
        _C,
        "pdcluster_kv_offload_stored_blocks",
        "KV blocks evicted from the pool into the offload tier",
        lambda w: _engine(w, w.kv_offload_stored_blocks),
    ),
    (
        _C,
        "pdcluster_kv_offload_restored_blocks",
        "KV blocks copied back from the offload tier instead of recomputed",
        lambda w: _engine(w, w.kv_offload_restored_blocks),
    ),
    (
        _C,
        "pdcluster_kv_offload_disk_restored_blocks",
        "KV blocks restored from the disk tier",
        lambda w: _engine(w, w.kv_offload_disk_restored_blocks),
    ),
    (
        _C,
        "pdcluster_kv_offload_peer_blocks_read",
        "KV blocks read from peer context workers' host tiers over NIXL",
        lambda w: _engine(w, w.kv_offload_peer_blocks_read),
    ),
    (
        _C,
        "pdcluster_kv_offload_peer_read_failures",
        "Reads of a peer's host tier that failed (the prompt was recomputed)",
        lambda w: _engine(w, w.kv_offload_peer_read_failures),
    ),
    (
        _C,
        "pdcluster_nixl_transfer_bytes",
        "KV bytes pulled over NIXL",
        lambda w: _gen(w, w.kv_bytes_pulled),
    ),
    (
        _C,
        "pdcluster_nixl_transfer_seconds",
        "Time pulling KV over NIXL",
        lambda w: _gen(w, w.kv_pull_seconds),
    ),
    (
        _C,
        "pdcluster_nixl_transfer_failures",
        "KV pulls that failed",
        lambda w: _gen(w, w.kv_pull_failures),
    ),
    (
        _C,
        "pdcluster_prompts_recomputed",
        "Handed-off prompts prefilled again on the generation worker (their KV was gone)",
        lambda w: _gen(w, w.prompts_recomputed),
    ),
    (_G, "pdcluster_postproc_queue_depth", "Requests being formatted", lambda w: _postproc(w)),
]


class RequestCounter:
    """ASGI middleware: every response counted by route and status, errors included."""

    def __init__(self, app: ASGIApp, routes: frozenset[str]) -> None:
        self.app = app
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = scope["path"] if scope["path"] in self.routes else "other"

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                REQUESTS.labels(route=route, status=str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


class ClusterCollector:
    """The per-worker families and the orchestrator's stage balance, from one ClusterInfo."""

    def __init__(self, info: ClusterInfo) -> None:
        self.info = info
        self.workers = [w for w in info.workers if w.role != "orchestrator"]

    def collect(self) -> list[Metric]:
        families: list[Metric] = []
        for kind, name, doc, value in WORKER_FAMILIES:
            family = kind(name, doc, labels=["worker", "role"])
            for worker in self.workers:
                v = value(worker)
                if v is not None:
                    family.add_metric([worker.worker_id, worker.role], v)
            families.append(family)
        queue = SummaryMetricFamily(
            "pdcluster_request_queue_time_seconds",
            "Time requests waited in an engine's queue before their first step",
            labels=["worker", "role"],
        )
        for w in self.workers:
            if w.role in ("context", "generation"):
                queue.add_metric([w.worker_id, w.role], w.num_admitted, w.queue_seconds)
        return [*families, queue, *self.stage_balance()]

    def stage_balance(self) -> list[Metric]:
        """The orchestrator's averages that max_prefill_queue_size "auto" compares, and its
        verdict: whether the context side is the bottleneck (orchestrator/stage_balance.py)."""
        averages = [
            (
                "pdcluster_first_token_wait_average_seconds",
                "Running average (last ~16 requests) from a request's receipt to its first "
                "token, over the prompts context workers prefilled",
                self.info.first_token_wait_s,
            ),
            (
                "pdcluster_decode_average_seconds",
                "Running average (last ~16 requests) from a request's hand-off to its last token",
                self.info.decode_s,
            ),
        ]
        families: list[Metric] = []
        for name, doc, value in averages:
            family = GaugeMetricFamily(name, doc)
            if value is not None:
                family.add_metric([], value)
            families.append(family)
        families.append(
            GaugeMetricFamily(
                "pdcluster_context_bound",
                "1 while first tokens wait clearly longer than decodes take: the context "
                "workers are the bottleneck, and max_prefill_queue_size auto deflects",
                value=float(self.info.context_bound),
            )
        )
        return families


def _engine(worker: WorkerInfo, value: float) -> float | None:
    return float(value) if worker.role in ("context", "generation") else None


def _gen(worker: WorkerInfo, value: float) -> float | None:
    return float(value) if worker.role == "generation" else None


def _postproc(worker: WorkerInfo) -> float | None:
    return float(worker.active_requests) if worker.role == "postproc" else None


def _hit_rate(worker: WorkerInfo) -> float | None:
    if worker.role not in ("context", "generation"):
        return None
    queried = worker.prefix_cache_queried_tokens
    return worker.prefix_cache_hit_tokens / queried if queried else 0.0


def render(info: ClusterInfo | None) -> bytes:
    """The whole scrape: every frontend process's families, then the cluster's."""
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    text = generate_latest(registry)
    if info is not None:
        cluster = CollectorRegistry()
        cluster.register(ClusterCollector(info))  # type: ignore[arg-type]
        text += generate_latest(cluster)
    return text
