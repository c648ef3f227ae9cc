"""Simulated frontends and workers around one real orchestrator, for bench/orchestrator_load.py:
each a DEALER with its id as identity, speaking the real protocol over CURVE, answering at once.

    frontends ──GenerateRequest──▶ orchestrator ──PrefillRequest──▶ context worker
    context worker ──PrefillDone (at once)──▶ orchestrator ──DecodeRequest──▶ generation worker
    generation worker ──RequestFinished (at once)──▶ orchestrator
    every peer ──Heartbeat (each interval)──▶ orchestrator;  engines ──KVEvents (the fill)──▶

All of them live in this process's one loop (`pump`), so every stamp is on one monotonic clock.
They read only the request id of what they receive: their decoding is not the orchestrator's.
They send no KV events for the requests they serve (a real engine worker reports each prompt's
new blocks, and its evictions): the fill's rate prices those per block.
The workload: prompts of 1024 tokens (64 blocks of 16), 256 output tokens; half the prompts
start with a 32-block chain one worker stored (a hit), half share nothing. Block hashes are
random 64-bit values: the orchestrator only compares them.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import numpy as np
import zmq

from common.curve import ClusterKeys, as_client
from common.kv_events import BlockStored
from common.protocol import (
    PROTOCOL_VERSION,
    ClusterInfoRequest,
    GenerateRequest,
    Heartbeat,
    KVEvents,
    KVPool,
    Message,
    OutputOptions,
    PrefillDone,
    Register,
    RequestFinished,
    TokenDelta,
    WorkerStats,
    decode,
    encode,
    encode_token_ids,
)
from common.sampling_params import SamplingParams
from common.transport import make_socket

BLOCK_SIZE = 16
PROMPT_BLOCKS = 64  # 1024-token prompts
OUTPUT_TOKENS = 256
HIT_RATIO = 0.5
CHAIN_BLOCKS = 32  # a stored prefix (512 tokens): the shared start of a hit prompt
CHAINS_PER_MESSAGE = 16  # one KVEvents: a busy engine step's BlockStored events
FILL_ROUND_MESSAGES = 64  # KVEvents sent before the fill waits for the orchestrator to catch up
RESERVOIR = 4096  # stored chains kept to start hit prompts with
PROMPT_POOL = 1024
FRONTENDS = 2
HEARTBEAT_INTERVAL_S = 0.5  # the default orchestrator.heartbeat_interval_seconds
WARMUP_S = 0.5
AGENT_METADATA = bytes(1024)  # a NIXL agent's metadata is about this size
WAIT_S = 60.0  # the longest any wait for the orchestrator may take


# What the simulated processes read of a message (msgspec skips the fields not named here).


class _Id(msgspec.Struct):
    request_id: str


class _Prefill(msgspec.Struct, tag_field="type", tag="prefill"):
    request: _Id


class _Decode(msgspec.Struct, tag_field="type", tag="decode"):
    request: _Id


class _Registered(msgspec.Struct, tag_field="type", tag="registered"):
    peers_version: int = 0


class _Info(msgspec.Struct, tag_field="type", tag="cluster_info"):
    pass


class _Failed(msgspec.Struct, tag_field="type", tag="failed"):
    request_id: str
    status_code: int
    message: str


_peek = msgspec.msgpack.Decoder(_Prefill | _Decode | _Registered | _Info | _Failed)


@dataclass(slots=True)
class Peer:
    """One simulated process: a DEALER whose identity is its id, as a real worker's."""

    worker_id: str
    role: str
    sock: zmq.Socket
    peers_version: int = 0  # of the last Registered (generation workers echo it in heartbeats)
    infos: int = 0  # ClusterInfo answers received (see Simulator.barrier)


@dataclass(slots=True)
class Prompt:
    block_hashes: list[int]
    holder: Peer | None  # the worker that stored its first chain, if it starts with one


@dataclass(slots=True)
class Saturated:
    routed: int  # requests that reached a generation worker in the counted window
    wall_s: float  # the window
    clock_s: float  # what the caller's clock (the orchestrator's CPU time) advanced in it
    load: Load


@dataclass(slots=True)
class Load:
    """The stamps and counts of one phase."""

    sent: dict[str, float] = field(default_factory=dict)
    holders: dict[str, Peer] = field(default_factory=dict)
    done_sent: dict[str, float] = field(default_factory=dict)
    route_s: list[float] = field(default_factory=list)
    decode_route_s: list[float] = field(default_factory=list)
    routed_at: list[float] = field(default_factory=list)  # DecodeRequest receipts
    submitted: int = 0
    hits: int = 0
    hits_to_holder: int = 0
    refill: bool = False  # closed loop: each routed request sends the next

    @property
    def in_flight(self) -> int:
        return len(self.sent) + len(self.done_sent)


class Simulator:
    """Frontends and workers around one orchestrator, all in this process's one loop."""

    def __init__(self, address: str, keys: ClusterKeys, num_workers: int, seed: int) -> None:
        self.context = zmq.Context()
        self.context.set(zmq.MAX_SOCKETS, 8192)
        self.address, self.keys = address, keys
        self.rng = random.Random(seed)
        self.np_rng = np.random.default_rng(seed)
        half = max(1, num_workers // 2)
        self.context_workers = [self.peer(f"ctx-{i}", "context") for i in range(half)]
        self.generation_workers = [self.peer(f"gen-{i}", "generation") for i in range(half)]
        self.postprocs = [self.peer(f"pp-{i}", "postproc") for i in range(max(2, half // 4))]
        self.frontends = [self.peer(f"fe-{i}", "frontend") for i in range(FRONTENDS)]
        self.engines = self.context_workers + self.generation_workers
        self.peers = self.engines + self.postprocs + self.frontends
        self.by_socket = {p.sock: p for p in self.peers}
        self.poller = zmq.Poller()
        for peer in self.peers:
            self.poller.register(peer.sock, zmq.POLLIN)
        self.load = Load()
        self.pool: list[Prompt] = []  # the prompts requests are drawn from, for this index
        self.failures: list[str] = []
        self.next_id = 0
        self.beating: list[Peer] = []  # the registered peers, which heartbeat
        self.heartbeats_due = 0.0  # owed since the last send, in heartbeats
        self.heartbeats_at = 0.0
        self.heartbeats_sent = 0
        self.stats = WorkerStats(blocks_total=65536, num_running=32, active_requests=32)
        # the index's fill: chains stored so far, and a uniform sample of them for hit prompts
        self.num_blocks = 0
        self.num_chains = 0
        self.reservoir: list[tuple[list[int], Peer]] = []
        self.token_ids = self.np_rng.integers(1000, 150_000, CHAIN_BLOCKS * BLOCK_SIZE).tolist()
        self.prompt_b64 = encode_token_ids(
            self.np_rng.integers(1000, 150_000, PROMPT_BLOCKS * BLOCK_SIZE).tolist()
        )

    def peer(self, worker_id: str, role: str) -> Peer:
        sock = make_socket(self.context, zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, worker_id.encode())
        as_client(sock, self.keys)
        sock.connect(self.address)
        return Peer(worker_id, role, sock)

    def close(self) -> None:
        for peer in self.peers:
            peer.sock.close()
        self.context.term()

    # --- the loop ----------------------------------------------------------------------------

    def pump(self, timeout_s: float) -> None:
        """Handle everything that arrives within `timeout_s`, and send the heartbeats due."""
        for sock, _ in self.poller.poll(max(0, int(timeout_s * 1000))):
            peer = self.by_socket[sock]
            while True:
                try:
                    frame = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self.on_frame(peer, frame)
        self.send_heartbeats()

    def on_frame(self, peer: Peer, frame: bytes) -> None:
        try:
            message = _peek.decode(frame)
        except msgspec.ValidationError:
            unexpected = decode(frame)  # Abort, RegisterAgain, Refused: none should come
            raise RuntimeError(f"{peer.worker_id} got {unexpected!r}") from None
        if isinstance(message, _Prefill):
            self.on_prefill(peer, message.request.request_id)
        elif isinstance(message, _Decode):
            self.on_decode(peer, message.request.request_id)
        elif isinstance(message, _Registered):
            peer.peers_version = message.peers_version
        elif isinstance(message, _Info):
            peer.infos += 1
        else:
            self.failures.append(f"{message.request_id}: {message.status_code} {message.message}")

    def send_heartbeats(self) -> None:
        """Every peer once per interval, spread evenly (the real ones come from a thread of each
        worker's own; these come from the worker's one socket, which the orchestrator cannot
        tell apart: it reads the id in the message)."""
        now = time.perf_counter()
        self.heartbeats_due += (now - self.heartbeats_at) / HEARTBEAT_INTERVAL_S * len(self.beating)
        self.heartbeats_at = now
        while self.heartbeats_due >= 1:
            self.heartbeats_due -= 1
            peer = self.beating[self.heartbeats_sent % len(self.beating)]
            beat = Heartbeat(worker_id=peer.worker_id, stats=self.stats, progress_age_s=0.01,
                             peers_version=peer.peers_version)  # fmt: skip
            self.send(peer, beat)
            self.heartbeats_sent += 1

    @staticmethod
    def send(peer: Peer, message: Message) -> None:
        peer.sock.send(encode(message))

    def wait(self, done: Callable[[], object], what: str) -> None:
        deadline = time.perf_counter() + WAIT_S
        while not done():
            if time.perf_counter() > deadline:
                raise RuntimeError(f"timed out waiting for {what}")
            self.pump(0.01)

    # --- registration and the index ----------------------------------------------------------

    def register(self) -> None:
        """Context workers first, then the rest: a generation worker registered before them
        would be sent the whole, growing peer set at every context worker's registration."""
        for group in (self.context_workers, self.generation_workers + self.postprocs,
                      self.frontends):  # fmt: skip
            for peer in group:
                self.send(peer, Register(
                    worker_id=peer.worker_id, role=peer.role,  # type: ignore[arg-type]
                    protocol_version=PROTOCOL_VERSION, pid=os.getpid(),
                    address=f"tcp://127.0.0.1:{9000 + len(peer.worker_id)}",  # never dialled
                    kv_pool=self.kv_pool(peer) if peer.role == "context" else None,
                    num_blocks=65536,
                ))  # fmt: skip
            self.barrier(group)
            self.beating += group  # as a real worker starts its heartbeats once registered

    @staticmethod
    def kv_pool(peer: Peer) -> KVPool:
        return KVPool(agent_name=f"{peer.worker_id}-agent", agent_metadata=AGENT_METADATA,
                      base_address=1 << 32, num_blocks=65536, block_num_bytes=1 << 16)  # fmt: skip

    def barrier(self, peers: list[Peer]) -> None:
        """A ClusterInfoRequest from each peer, and wait for every answer: the orchestrator reads
        each socket in order, so everything the peers sent before it has been handled."""
        targets = [(peer, peer.infos + 1) for peer in peers]
        for peer in peers:
            self.send(peer, ClusterInfoRequest())
        self.wait(lambda: all(p.infos >= n for p, n in targets), "the orchestrator's answers")

    def fill(self, num_blocks: int) -> float:
        """Store chains on the engine workers, round robin, through KV events (as a worker's step
        sends them) until the index holds `num_blocks`; returns the seconds it took."""
        start = time.perf_counter()
        senders: dict[str, Peer] = {}  # the barrier at the end waits for these only
        sent = 0
        while self.num_blocks < num_blocks:
            peer = self.engines[self.num_chains // CHAINS_PER_MESSAGE % len(self.engines)]
            events = []
            for _ in range(CHAINS_PER_MESSAGE):
                length = min(CHAIN_BLOCKS, num_blocks - self.num_blocks)
                if length <= 0:
                    break
                chain = self.np_rng.integers(0, 2**64, length, dtype=np.uint64).tolist()
                events.append(BlockStored(chain, None, self.token_ids[: length * BLOCK_SIZE],
                                          BLOCK_SIZE))  # fmt: skip
                self.keep(chain, peer)
                self.num_blocks += length
            self.send(peer, KVEvents(worker_id=peer.worker_id, events=events))
            senders[peer.worker_id] = peer
            sent += 1
            if sent % FILL_ROUND_MESSAGES == 0:
                self.barrier([peer])  # the orchestrator is at most a round behind
            self.send_heartbeats()
        self.barrier(list(senders.values()))
        return time.perf_counter() - start

    def keep(self, chain: list[int], holder: Peer) -> None:
        """Reservoir sampling: every stored chain is equally likely to start a hit prompt."""
        self.num_chains += 1
        if len(chain) < CHAIN_BLOCKS:
            return
        if len(self.reservoir) < RESERVOIR:
            self.reservoir.append((chain, holder))
        elif (slot := self.rng.randrange(self.num_chains)) < RESERVOIR:
            self.reservoir[slot] = (chain, holder)

    def prompts(self) -> list[Prompt]:
        """Half start with a stored chain (a prefix-cache hit on its holder), half are new."""
        out = []
        for _ in range(PROMPT_POOL):
            fresh = [self.rng.getrandbits(64) for _ in range(PROMPT_BLOCKS)]
            if self.reservoir and self.rng.random() < HIT_RATIO:
                chain, holder = self.rng.choice(self.reservoir)
                out.append(Prompt(chain + fresh[CHAIN_BLOCKS:], holder))
            else:
                out.append(Prompt(fresh, None))
        return out

    # --- requests ----------------------------------------------------------------------------

    def submit(self, prompt: Prompt) -> None:
        request_id = f"cmpl-{self.next_id}"
        frontend = self.frontends[self.next_id % len(self.frontends)]
        self.next_id += 1
        request = GenerateRequest(
            request_id=request_id,
            prompt_token_ids_b64=self.prompt_b64,
            sampling=SamplingParams(max_tokens=OUTPUT_TOKENS),
            output=OutputOptions(kind="chat", model="bench", stream=True),
            reply_to="tcp://127.0.0.1:9",  # the frontend's PULL: the orchestrator never dials it
            num_prompt_tokens=PROMPT_BLOCKS * BLOCK_SIZE,
            prompt_block_hashes=prompt.block_hashes,
        )
        if prompt.holder is not None:
            self.load.holders[request_id] = prompt.holder
        self.load.submitted += 1
        self.load.sent[request_id] = time.perf_counter()
        self.send(frontend, request)

    def on_prefill(self, peer: Peer, request_id: str) -> None:
        load = self.load
        load.route_s.append(time.perf_counter() - load.sent.pop(request_id))
        self.count_hit(peer, request_id, "context")
        first = TokenDelta(request_id, 0, [1000], num_prompt_tokens=PROMPT_BLOCKS * BLOCK_SIZE)
        done = PrefillDone(request_id=request_id, worker_id=peer.worker_id,
                           agent_name=f"{peer.worker_id}-agent", first=[first],
                           block_ids=list(range(PROMPT_BLOCKS)), lease_s=30.0)  # fmt: skip
        self.send(peer, done)
        load.done_sent[request_id] = time.perf_counter()

    def on_decode(self, peer: Peer, request_id: str) -> None:
        load = self.load
        now = time.perf_counter()
        load.decode_route_s.append(now - load.done_sent.pop(request_id))
        load.routed_at.append(now)
        self.count_hit(peer, request_id, "generation")
        finished = RequestFinished(
            request_id=request_id,
            worker_id=peer.worker_id,
            finish_reason="length",
            num_output_tokens=OUTPUT_TOKENS,
        )
        self.send(peer, finished)
        if load.refill:
            self.submit(self.rng.choice(self.pool))

    def count_hit(self, peer: Peer, request_id: str, role: str) -> None:
        holder = self.load.holders.get(request_id)
        if holder is not None and holder.role == role:
            self.load.hits += 1
            self.load.hits_to_holder += holder is peer

    def saturate(self, duration_s: float, window: int, clock: Callable[[], float]) -> Saturated:
        """Closed loop with `window` requests in flight; what was routed after the warm-up, in
        how long, and what `clock` (the orchestrator's CPU time) advanced meanwhile."""
        self.load = Load(refill=True)
        start = time.perf_counter()
        for _ in range(window):
            self.submit(self.rng.choice(self.pool))
        while (now := time.perf_counter()) < start + WARMUP_S:
            self.pump(0.01)
        counted_from, clock_from = now, clock()
        while time.perf_counter() < start + duration_s:
            self.pump(0.01)
        end, clock_s = time.perf_counter(), clock() - clock_from
        self.drain()
        routed = sum(1 for t in self.load.routed_at if counted_from <= t <= end)
        if not routed:
            raise RuntimeError(f"nothing was routed in {end - counted_from:.1f} s")
        return Saturated(routed, end - counted_from, clock_s, self.load)

    def paced(self, rate: float, duration_s: float) -> Load:
        """Open loop at `rate` requests/s (sends catch up when the loop falls behind)."""
        self.load = Load()
        start = next_at = time.perf_counter()
        while next_at < start + duration_s:
            while next_at <= time.perf_counter():
                self.submit(self.rng.choice(self.pool))
                next_at += 1 / rate
            self.pump(next_at - time.perf_counter())
        self.drain()
        return self.load

    def drain(self) -> None:
        self.load.refill = False
        self.wait(lambda: not self.load.in_flight or self.failures, "the requests in flight")
        if self.failures:
            raise RuntimeError(f"{len(self.failures)} requests failed: {self.failures[:3]}")
