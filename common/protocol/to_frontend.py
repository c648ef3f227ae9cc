"""What frontends receive: a request's bytes from its postproc worker (Chunk), its failure
from the orchestrator (RequestFailed), and the answers to their cluster queries.

RequestFailed is first sent by a worker to the orchestrator, which ends the request and
forwards it; ProfileDone is first each engine worker's answer, merged by the orchestrator.
WorkerInfo is also what `orchestrator status` shows.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from common.protocol.to_orchestrator import WorkerStats
from common.protocol.wire import _Message
from common.stage_times import StageTimes


class Chunk(_Message, tag="chunk"):
    """Bytes ready for the client: SSE frames when streaming, the whole JSON body otherwise.
    A `status_code` other than 200 makes `data` an error body and ends the request."""

    request_id: str
    data: bytes
    done: bool = False
    status_code: int = 200
    # On the ending chunk, the request's usage as numbers: for the frontend's metrics, and for
    # the usage it sums over the sub-requests of a prompt list (OutputOptions.fanned_out)
    prompt_tokens: int = 0  # as billed
    cached_tokens: int = 0  # of those, found in a prefix cache
    completion_tokens: int = 0  # every sampled choice's
    # On the ending chunk: for the Server-Timing header (and a fanned-out stream's perf_metrics)
    times: StageTimes | None = None


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


class WorkerInfo(WorkerStats, omit_defaults=False, kw_only=True):
    """One row of `orchestrator status` and GET /cluster_info: who, where, and its last stats."""

    worker_id: str
    role: str  # orchestrator | context | generation | postproc | frontend
    pid: int
    address: str
    state: str  # ready | stalled (alive, its loop not progressing) | draining | dead
    progress_age_s: float = 0.0  # since its loop last finished a step
    events_address: str = ""  # its KV-event PUB socket, if it publishes
    requests_routed: int = 0  # requests the orchestrator assigned to it, in all
    local_prefills_routed: int = 0  # prompts it was sent to prefill itself, in all
    last_heartbeat_s: float = 0.0  # seconds since the last heartbeat


class ClusterInfo(_Message, tag="cluster_info", omit_defaults=False):
    """GET /cluster_info and `orchestrator status`, every field written, defaults too: a reader
    finds `context_bound: false` and `decode_s: null`, not a missing key."""

    workers: list[WorkerInfo]
    num_requests: int = 0  # requests the orchestrator is tracking
    # the LoRA adapters served (name -> PEFT directory): cluster.yaml's and those loaded since
    lora_adapters: dict[str, str] = msgspec.field(default_factory=dict)
    # What max_prefill_queue_size "auto" weighs (orchestrator/stage_balance.py), kept whatever
    # it is set to: running averages over the last ~16 requests of the wait from the cluster's
    # receipt to a context worker's first token and of the time from hand-off to the last
    # token (None until measured), and the verdict drawn from them
    first_token_wait_s: float | None = None
    decode_s: float | None = None
    context_bound: bool = False


class KVEventsDrained(_Message, tag="kv_events_drained"):
    events_json: bytes  # a JSON array in TensorRT-LLM's shape


class LoRADone(_Message, tag="lora_done"):
    """One engine worker's answer to a LoRACommand, or (orchestrator → frontend) all of them."""

    action: Literal["load", "unload"]
    lora_name: str
    workers: list[str] = msgspec.field(default_factory=list)  # the workers that did it
    errors: list[str] = msgspec.field(default_factory=list)  # "<worker id>: <why>"


class ProfileDone(_Message, tag="profile_done"):
    """One engine worker's answer to a Profile, or (orchestrator → frontend) all of them."""

    action: Literal["start", "stop"]
    workers: list[str] = msgspec.field(default_factory=list)  # the workers that did it
    files: list[str] = msgspec.field(default_factory=list)  # traces and tables written (stop)
    errors: list[str] = msgspec.field(default_factory=list)  # "<worker id>: <why>"
