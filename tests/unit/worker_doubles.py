"""What the worker-loop tests run the socket-free workers with: a clock the test moves, and NIXL
agents that copy KV blocks between two engines' pools in-process (as a READ does), with reads
the test can hold pending or fail."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path

import torch

from common.config import ClusterConfig, parse_cluster_config
from common.protocol import (
    DecodeRequest,
    GenerateRequest,
    KVPool,
    Message,
    OutputOptions,
    PrefillDone,
    PrefillRequest,
    encode_token_ids,
    pack_postproc_start,
)
from common.sampling_params import SamplingParams
from common.worker_process import ORCHESTRATOR, Outbox
from engine.kv_transfer import KVTransferError, TransferHandle

BLOCK_SIZE = 4
NUM_BLOCKS = 64
POSTPROC = "tcp://127.0.0.1:9"  # a postproc worker's PULL address; nothing listens there
FRONTEND = "tcp://127.0.0.1:10"


@dataclass
class Clock:
    """time.monotonic for a worker, moved by the test."""

    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


def cluster_config(model: Path, **transfer: object) -> ClusterConfig:
    options = ", ".join(f"{k}: {str(v).lower()}" for k, v in transfer.items())
    return parse_cluster_config(
        f"model: {model}\nkv_cache: {{block_size: {BLOCK_SIZE}, num_blocks: {NUM_BLOCKS}}}\n"
        f"transfer: {{{options}}}\n"
    )


def generate_request(
    request_id: str, prompt: list[int], sampling: SamplingParams, stream: bool = False
) -> GenerateRequest:
    return GenerateRequest(
        request_id=request_id,
        prompt_token_ids_b64=encode_token_ids(prompt),
        sampling=sampling,
        output=OutputOptions(kind="completion", model="tiny", stream=stream),
        reply_to=FRONTEND,
        num_prompt_tokens=len(prompt),
    )


def prefill_request(request: GenerateRequest) -> PrefillRequest:
    """As the orchestrator makes it (Orchestrator.start_prefill)."""
    return PrefillRequest(
        request=request.engine_request(),
        postproc_address=POSTPROC,
        postproc_start=pack_postproc_start(request.postproc_start()),
    )


def decode_request(request: GenerateRequest, prefill: PrefillDone | None = None) -> DecodeRequest:
    """As the orchestrator makes it (Orchestrator.start_decode)."""
    engine = request.engine_request()
    return DecodeRequest(
        request=engine if prefill is None else engine.without_pixels(),
        postproc_address=POSTPROC,
        postproc_start=pack_postproc_start(request.postproc_start()),
        prefill=prefill,
    )


def sent(out: Outbox, destination: str = ORCHESTRATOR) -> list[Message]:
    return [message for to, message in out if to == destination]


@dataclass(eq=False)
class FakeAgent:
    """A KVTransferAgent over `pool` whose peers are the agents in `fabric` (by name). A READ
    copies the blocks at once and notifies the source, as CMA does on one host, unless
    `hold_reads` keeps it pending until `complete` or `fail`."""

    name: str
    pool: torch.Tensor
    fabric: dict[str, FakeAgent]
    hold_reads: bool = False
    reads: dict[int, tuple[TransferHandle, list[int], list[int], bytes]] = field(
        default_factory=dict
    )
    released: list[TransferHandle] = field(default_factory=list)
    notifications: list[tuple[str, bytes]] = field(default_factory=list)
    closed: bool = False
    _peers: set[str] = field(default_factory=set)
    _ids: itertools.count = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        self.fabric[self.name] = self

    def info(self) -> KVPool:
        return KVPool(
            agent_name=self.name,
            agent_metadata=b"",
            base_address=0,
            num_blocks=self.pool.shape[0],
            block_num_bytes=self.pool[0].numel() * self.pool.element_size(),
        )

    @property
    def peer_names(self) -> list[str]:
        return sorted(self._peers)

    def add_peer(self, peer: KVPool) -> None:
        self._peers.add(peer.agent_name)

    def remove_peer(self, peer_name: str) -> None:
        self._peers.discard(peer_name)

    def start_read(
        self,
        peer_name: str,
        remote_block_ids: list[int],
        local_block_ids: list[int],
        notification: bytes,
        timeout_s: float,
    ) -> TransferHandle:
        if peer_name not in self._peers:
            raise KVTransferError(f"unknown peer {peer_name!r}")
        num_bytes = len(remote_block_ids) * self.pool[0].numel() * self.pool.element_size()
        handle = TransferHandle(
            next(self._ids), peer_name, len(remote_block_ids), num_bytes, 0.0, timeout_s
        )
        self.reads[handle.transfer_id] = (handle, remote_block_ids, local_block_ids, notification)
        if not self.hold_reads:
            self.complete(handle)
        return handle

    def complete(self, handle: TransferHandle) -> None:
        _, remote, local, notification = self.reads.pop(handle.transfer_id)
        source = self.fabric[handle.peer_name]
        for src, dst in zip(remote, local, strict=True):
            self.pool[dst] = source.pool[src]
        handle.state, handle.seconds = "done", 0.001
        source.notifications.append((self.name, notification))

    def fail(self, handle: TransferHandle, error: str) -> None:
        del self.reads[handle.transfer_id]
        handle.state, handle.error = "failed", error

    def poll(self, handle: TransferHandle) -> str:
        return handle.state

    def release(self, handle: TransferHandle) -> None:
        self.reads.pop(handle.transfer_id, None)  # a READ in flight is cancelled
        self.released.append(handle)

    def notify(self, peer_name: str, message: bytes) -> None:
        if peer_name not in self.fabric:
            raise KVTransferError(f"unknown peer {peer_name!r}")
        self.fabric[peer_name].notifications.append((self.name, message))

    def take_notifications(self) -> list[tuple[str, bytes]]:
        taken, self.notifications = self.notifications, []
        return taken

    def close(self) -> None:
        self.closed = True
