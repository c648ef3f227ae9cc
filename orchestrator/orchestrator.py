"""The orchestrator's logic, without sockets: messages in, (recipient, message) pairs out.

Request state machine (a request leaves the table when it ends):

    queued ──▶ prefilling ──PrefillDone──▶ decoding ──RequestFinished──▶ finished
      │  (context worker)      │  (first token ends it)                   ──RequestFailed──▶ failed
      └─ aggregated, a short prompt, or (max_prefill_queue_size) the context queues full
                                    ─▶ decoding (the generation worker prefills)
    any state ──Abort (client gone, stop string)──▶ aborted

Retries happen only before the first token: a request whose context worker dies while
prefilling is sent to another one. Once decoding, a dead worker fails the request.
Abort goes to the context worker only while it prefills; after the hand-off the generation worker
owns the request and tells the context worker itself (NIXL notification) to free its lease.
"""

from __future__ import annotations

import enum
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from common.config import ClusterConfig
from common.kv_events import BlockRemoved, BlockStored
from common.protocol import (
    PROTOCOL_VERSION,
    Abort,
    ClusterInfo,
    ClusterInfoRequest,
    DecodeRequest,
    Drain,
    DrainKVEvents,
    EngineRequest,
    GenerateRequest,
    Heartbeat,
    KVEvents,
    KVEventsDrained,
    Leaving,
    LoRACommand,
    LoRADone,
    Message,
    PeersRequest,
    PrefillDone,
    PrefillRequest,
    Profile,
    ProfileDone,
    Refused,
    Register,
    RegisterAgain,
    Registered,
    RequestFailed,
    RequestFinished,
    WorkerInfo,
    pack_postproc_start,
)
from orchestrator.conversations import ConversationAffinity
from orchestrator.kv_event_log import KVEventLog
from orchestrator.lora_round import LoRARound
from orchestrator.profile_round import ProfileRound
from orchestrator.registry import Registry, WorkerRecord
from orchestrator.router import PrefixIndex, make_router
from orchestrator.stage_balance import StageBalance
from orchestrator.worker_round import WorkerRound

logger = logging.getLogger(__name__)

Outbox = list[tuple[bytes, Message]]
MAX_PREFILL_ATTEMPTS = 2
# max_prefill_queue_size "auto"'s queue: a prompt deflects only where it would wait behind a
# whole prefill (one running, one queued), as the runs that measured deflection set it
AUTO_PREFILL_QUEUE_SIZE = 2
NO_DECODER = "no generation worker is up"
DUPLICATE_WINDOW_HEARTBEATS = 2


class State(enum.Enum):
    QUEUED = "queued"
    PREFILLING = "prefilling"
    DECODING = "decoding"


@dataclass(slots=True)
class RequestRecord:
    request: GenerateRequest
    frontend: bytes  # the ROUTER identity to send RequestFailed to
    # The request split once, by receiver: what engine workers read, and the postproc worker's
    # part, packed, which an engine worker forwards with the first tokens
    engine: EngineRequest
    postproc_start: msgspec.Raw
    postproc_address: str = ""
    postproc_worker_id: str = ""
    state: State = State.QUEUED
    context_worker: WorkerRecord | None = None
    generation_worker: WorkerRecord | None = None
    prefill_attempts: int = 0
    received_at: float = 0.0  # the orchestrator's clock, for StageTimes.first_token_s
    handed_off_at: float = 0.0  # when its decode was sent with a context worker's KV (or 0)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def load(self) -> int:
        """Tokens it adds to a worker's load: the prompt and all it may generate."""
        sampling = self.request.sampling
        return self.request.num_prompt_tokens + sampling.n * sampling.max_tokens


class Orchestrator:
    def __init__(self, config: ClusterConfig, address: str = "") -> None:
        self.config = config
        self.address = address
        self.registry = Registry(
            config.orchestrator.worker_timeout_seconds, config.orchestrator.stall_timeout_seconds
        )
        self.prefix_index = PrefixIndex()  # fed by the workers' KV events
        self.kv_events = KVEventLog()
        block_size = config.kv_cache.block_size
        router = config.orchestrator.router
        self.context_router = ConversationAffinity(
            make_router(router, self.prefix_index, block_size)
        )
        self.generation_router = ConversationAffinity(
            make_router(router, self.prefix_index, block_size)
        )
        self.requests: dict[str, RequestRecord] = {}
        self.stage_balance = StageBalance()  # for max_prefill_queue_size "auto"
        self.peers_version = 0
        self._peer_names: tuple[str, ...] = ()  # the agents `peers_version` lists
        self._peers_checked = -1  # the registry version they were last checked against
        self.profile_round: ProfileRound | None = None
        # the LoRA adapters served, name -> path (GET /v1/models): cluster.yaml's, then the
        # outcome of each load / unload round (lora_round.py)
        self.lora_adapters = dict(config.lora.adapters) if config.lora else {}
        self.lora_round: LoRARound | None = None

    # --- dispatch ---------------------------------------------------------------------------------

    def handle(self, sender: bytes, message: Message, now: float) -> Outbox:
        out: Outbox = []
        if isinstance(message, GenerateRequest):
            self.on_generate(sender, message, now, out)
        elif isinstance(message, PrefillDone):
            self.on_prefill_done(message, now, out)
        elif isinstance(message, RequestFinished):
            self.on_finished(message, now)
        elif isinstance(message, RequestFailed):
            self.fail(message.request_id, message, out)
        elif isinstance(message, Abort):
            self.abort(message.request_id, out)
        elif isinstance(message, Heartbeat):
            self.on_heartbeat(sender, message, now, out)
        elif isinstance(message, PeersRequest):
            out.append((message.worker_id.encode(), self.peers()))
        elif isinstance(message, Register):
            self.on_register(sender, message, now, out)
        elif isinstance(message, Drain):
            self.on_drain(message, out)
        elif isinstance(message, Leaving):
            self.on_leaving(message, out)
        elif isinstance(message, ClusterInfoRequest):
            out.append((sender, self.cluster_info(now)))
        elif isinstance(message, KVEvents):
            self.on_kv_events(message)
        elif isinstance(message, DrainKVEvents):
            out.append((sender, KVEventsDrained(events_json=self.kv_events.drain())))
        elif isinstance(message, Profile):
            self.on_profile(sender, message, now, out)
        elif isinstance(message, ProfileDone):
            self.on_profile_done(sender, message, out)
        elif isinstance(message, LoRACommand):
            self.on_lora(sender, message, now, out)
        elif isinstance(message, LoRADone):
            self.on_lora_done(sender, message, out)
        else:
            logger.warning("ignored a %s from %r", type(message).__name__, sender)
        self.update_peers(out)
        return out

    def tick(self, now: float) -> Outbox:
        """Periodic: find the dead, and deal with their requests."""
        out: Outbox = []
        self.registry.forget_dead(now)
        for worker in self.registry.expire(now):
            logger.error(
                "%s %s (pid %d) missed its heartbeats for %.1f s: marked dead",
                worker.role,
                worker.worker_id,
                worker.pid,
                now - worker.last_seen,
            )
            self.worker_lost(worker, out)
        self.tell_draining(out)
        self.check_profile_round(now, out)
        self.check_lora_round(now, out)
        self.update_peers(out)
        return out

    # --- registration -----------------------------------------------------------------------------

    def on_register(self, sender: bytes, message: Register, now: float, out: Outbox) -> None:
        reason = self.refusal(message, now)
        if reason is not None:
            logger.error("refused a registration: %s", reason)
            out.append((sender, Refused(reason=reason)))
            return
        old = self.registry.register(message, now)
        if old is not None and old.instance != message.instance:
            logger.warning("%s restarted (pid %d -> %d)", message.worker_id, old.pid, message.pid)
            self.worker_lost(old, out)
        logger.info("%s %s registered (pid %d)", message.role, message.worker_id, message.pid)
        if message.role in ("context", "generation"):
            self.prefix_index.cleared(message.worker_id)  # a new process starts with no cache
            self.kv_events.created(message.worker_id, message.num_blocks)
            if old is None or old.instance != message.instance:
                self.send_loaded_adapters(sender, out)
        out.append((sender, self.peers()))

    def send_loaded_adapters(self, worker: bytes, out: Outbox) -> None:
        """A new engine process has cluster.yaml's adapters only: the ones loaded since (its
        answers come outside any round and are dropped; a refusal is in its log)."""
        configured = self.config.lora.adapters if self.config.lora else {}
        for name, path in self.lora_adapters.items():
            if configured.get(name) != path:
                out.append((worker, LoRACommand(action="load", lora_name=name, lora_path=path)))

    def refusal(self, message: Register, now: float) -> str | None:
        """Why a registration is refused: another protocol version, or a second process under
        the id of a worker that is alive; None to accept it."""
        if message.protocol_version != PROTOCOL_VERSION:
            return (
                f"{message.worker_id} speaks protocol version {message.protocol_version}, this"
                f" orchestrator {PROTOCOL_VERSION}: run the same release everywhere"
            )
        held = self.registry.workers.get(message.worker_id)
        if held is not None and held.instance != message.instance and self.heard_lately(held, now):
            return (
                f"worker id {message.worker_id} is held by a live process (pid {held.pid}, "
                f"heard from {now - held.last_seen:.1f} s ago): pid {message.pid} is a duplicate"
            )
        return None

    def heard_lately(self, worker: WorkerRecord, now: float) -> bool:
        """Within two heartbeats: the process is surely alive (a crashed one is restarted only
        after a back-off longer than that)."""
        interval_s = self.config.orchestrator.heartbeat_interval_seconds
        return worker.alive and now - worker.last_seen < DUPLICATE_WINDOW_HEARTBEATS * interval_s

    def on_heartbeat(self, sender: bytes, message: Heartbeat, now: float, out: Outbox) -> None:
        worker = self.registry.heartbeat(message, now)
        if worker is None:
            out.append((sender, RegisterAgain()))  # to the heartbeat socket: the worker's thread
        elif not worker.alive:
            # Back from dead (a partition healed, a stopped process resumed): taken back when it
            # registers in answer to this, sent on its command socket. The round trip proves
            # that socket delivers again: after a partition TCP's retransmission backoff can
            # hold what was queued to it (the aborts of its lost requests) for many seconds
            # after the link is back, and new work sent behind that would arrive late, a
            # decode request after its KV lease ran out.
            out.append((worker.worker_id.encode(), RegisterAgain()))
        elif worker.role in self.peer_roles and message.peers_version != self.peers_version:
            out.append((worker.worker_id.encode(), self.peers()))  # a lost or missed update

    # --- drain (scaling down, a Kubernetes pod's preStop) ---------------------------------------

    def on_drain(self, message: Drain, out: Outbox) -> None:
        """Take a worker out of routing; it is told (and told again, each time the number
        changes) how many requests in the table still pass through it."""
        worker = self.registry.drain(message.worker_id)
        if worker is None:
            logger.warning("drain of %s ignored: no such live worker", message.worker_id)
            return
        worker.drain_in_flight_told = None  # a repeated Drain (the worker registered again)
        self.tell_draining(out)

    def tell_draining(self, out: Outbox) -> None:
        for worker in self.registry.workers.values():
            if not worker.draining:
                continue
            in_flight = sum(1 for r in self.requests.values() if self.touches(r, worker))
            if in_flight != worker.drain_in_flight_told:
                worker.drain_in_flight_told = in_flight
                drain = Drain(worker_id=worker.worker_id, in_flight=in_flight)
                out.append((worker.worker_id.encode(), drain))

    def on_leaving(self, message: Leaving, out: Outbox) -> None:
        """A drained worker exits: forget it at once. Anything it still held (it ran out of
        drain time) fails now, as a dead worker's requests do."""
        worker = self.registry.leave(message.worker_id)
        if worker is None:
            return
        logger.info("%s %s left (drained)", worker.role, worker.worker_id)
        self.worker_lost(worker, out)

    def on_kv_events(self, message: KVEvents) -> None:
        """Feed the router's index and the /kv_cache_events queue, in event order."""
        index, log, worker_id = self.prefix_index, self.kv_events, message.worker_id
        for event in message.events:
            if isinstance(event, BlockStored):
                index.stored(worker_id, event.block_hashes, event.medium)
                log.stored(worker_id, event)
            elif isinstance(event, BlockRemoved):
                index.removed(worker_id, event.block_hashes, event.medium)
                log.removed(worker_id, event.block_hashes, event.medium)
            else:  # cleared: TensorRT-LLM's consumers only know removals
                log.removed(worker_id, sorted(index.held(worker_id)))
                index.cleared(worker_id)

    def peers(self) -> Registered:
        return Registered(peers=self.registry.kv_pools(), peers_version=self.peers_version)

    def update_peers(self, out: Outbox) -> None:
        """After every message and tick: when the live context workers changed (one registered,
        restarted, died or came back), a new version goes to every live generation worker.
        Heartbeats carry the version each one applied, so a lost update is sent again."""
        if self.registry.version == self._peers_checked:
            return  # no worker came, went or changed state since the last look
        self._peers_checked = self.registry.version
        names = tuple(pool.agent_name for pool in self.registry.kv_pools())
        if names == self._peer_names:
            return
        self._peer_names = names
        self.peers_version += 1
        update = self.peers()
        for role in self.peer_roles:
            for worker in self.registry.live(role):
                out.append((worker.worker_id.encode(), update))

    @property
    def peer_roles(self) -> tuple[str, ...]:
        """Who reads context workers over NIXL: generation workers (leased KV) and, with the
        offload tier on, context workers too (each other's host tiers)."""
        if self.config.kv_cache.offload.enabled:
            return ("generation", "context")
        return ("generation",)

    # --- LoRA adapters (POST /v1/load_lora_adapter, /v1/unload_lora_adapter) ----------------------

    def on_lora(self, sender: bytes, command: LoRACommand, now: float, out: Outbox) -> None:
        refusal = None
        if self.lora_round is not None:
            refusal = f"orchestrator: a LoRA {self.lora_round.command.action} is in progress"
        ids = self.live_engine_ids()
        if not ids:
            refusal = "orchestrator: no engine worker is up"
        if refusal is not None:
            done = LoRADone(action=command.action, lora_name=command.lora_name, errors=[refusal])
            out.append((sender, done))
            return
        self.lora_round = LoRARound.begin(sender, command, ids, now)
        out.extend((worker_id.encode(), command) for worker_id in ids)

    def on_lora_done(self, sender: bytes, done: LoRADone, out: Outbox) -> None:
        if self.lora_round is not None:
            self.lora_round.on_answer(sender.decode(errors="replace"), done)
            self.end_lora_round(out)

    def live_engine_ids(self) -> list[str]:
        """The engine workers a fanned-out round (LoRA, profile) is sent to."""
        engines = self.registry.live("context") + self.registry.live("generation")
        return [worker.worker_id for worker in engines]

    def stop_waiting_for_the_lost(self, round_: WorkerRound[Any], now: float) -> None:
        """Each tick of a fanned-out round: a worker that died since the command is not waited
        for, nor is any once the deadline passed."""
        for worker_id in list(round_.waiting):
            worker = self.registry.workers.get(worker_id)
            if worker is None or not worker.alive:
                round_.give_up_on(worker_id, "lost before it answered")
        round_.expire(now)

    def check_lora_round(self, now: float, out: Outbox) -> None:
        if self.lora_round is not None:
            self.stop_waiting_for_the_lost(self.lora_round, now)
            self.end_lora_round(out)

    def end_lora_round(self, out: Outbox) -> None:
        if self.lora_round is not None and self.lora_round.complete:
            self.lora_round.apply(self.lora_adapters)
            out.append((self.lora_round.asker, self.lora_round.answer))
            self.lora_round = None

    # --- profiling (POST /start_profile, /stop_profile) ---------------------------------------

    def on_profile(self, sender: bytes, command: Profile, now: float, out: Outbox) -> None:
        if self.profile_round is not None:
            busy = f"orchestrator: a {self.profile_round.answer.action} is in progress"
            out.append((sender, ProfileDone(action=command.action, errors=[busy])))
            return
        ids = self.live_engine_ids()
        if not ids:
            refusal = "orchestrator: no engine worker is up"
            out.append((sender, ProfileDone(action=command.action, errors=[refusal])))
            return
        self.profile_round = ProfileRound.begin(sender, command, ids, now)
        out.extend((worker_id.encode(), command) for worker_id in ids)

    def on_profile_done(self, sender: bytes, done: ProfileDone, out: Outbox) -> None:
        if self.profile_round is not None:
            self.profile_round.on_answer(sender.decode(errors="replace"), done)
            self.end_profile_round(out)

    def check_profile_round(self, now: float, out: Outbox) -> None:
        if self.profile_round is not None:
            self.stop_waiting_for_the_lost(self.profile_round, now)
            self.end_profile_round(out)

    def end_profile_round(self, out: Outbox) -> None:
        if self.profile_round is not None and self.profile_round.complete:
            out.append((self.profile_round.asker, self.profile_round.answer))
            self.profile_round = None

    def cluster_info(self, now: float) -> ClusterInfo:
        me = WorkerInfo(
            worker_id="orchestrator",
            role="orchestrator",
            pid=os.getpid(),
            address=self.address,
            state="ready",
            active_requests=len(self.requests),
        )
        workers = sorted(self.registry.workers.values(), key=lambda w: (w.role, w.worker_id))
        return ClusterInfo(
            workers=[me, *(w.info(now) for w in workers)],
            num_requests=len(self.requests),
            lora_adapters=self.lora_adapters,
            first_token_wait_s=self.stage_balance.first_token_s,
            decode_s=self.stage_balance.decode_s,
            context_bound=self.stage_balance.context_bound(),
        )

    # --- requests ---------------------------------------------------------------------------------

    def on_generate(self, sender: bytes, request: GenerateRequest, now: float, out: Outbox) -> None:
        if request.request_id in self.requests:
            failed = self.failure(request.request_id, 400, "this request id is already in use")
            out.append((sender, failed))
            return
        limit = self.config.orchestrator.max_requests
        if len(self.requests) >= limit and not self.shed_for(request, out):
            busy = f"the cluster is at capacity ({limit} requests in flight); retry shortly"
            out.append((sender, self.failure(request.request_id, 429, busy)))
            return
        record = RequestRecord(
            request,
            sender,
            request.engine_request(),
            pack_postproc_start(request.postproc_start()),
            received_at=now,
        )
        postproc = self.registry.postproc_for(request.request_id)
        if postproc is None:
            out.append((sender, self.failure(request.request_id, 503, "no postproc worker is up")))
            return
        record.postproc_address = postproc.address
        record.postproc_worker_id = postproc.worker_id
        self.requests[request.request_id] = record
        if not self.registry.routable("generation"):  # a prefill would only hold blocks
            self.fail(record.request_id, self.failure(request.request_id, 503, NO_DECODER), out)
        elif self.prefills_locally(record):
            self.start_decode(record, None, out)
        else:
            self.start_prefill(record, out)

    def shed_for(self, request: GenerateRequest, out: Outbox) -> bool:
        """At capacity: make room for `request` by ending the lowest-priority request (the
        latest of its level) that has a lower priority and has not reached a generation worker
        yet, so its client has seen nothing; it gets a 429 to retry. False: none to shed."""
        waiting = [
            r
            for r in self.requests.values()
            if r.state in (State.QUEUED, State.PREFILLING) and r.request.priority < request.priority
        ]  # dicts keep insertion order: arrival order
        if not waiting:
            return False
        victim = min(reversed(waiting), key=lambda r: r.request.priority)
        message = "shed for a higher-priority request at capacity; retry shortly"
        self.fail(victim.request_id, self.failure(victim.request_id, 429, message), out)
        return True

    def prefills_locally(self, record: RequestRecord) -> bool:
        """Aggregated mode, a short prompt, no context worker up, or every context worker's
        queue full: skip the hand-off."""
        if self.config.mode == "aggregated":
            return True
        if record.request.num_prompt_tokens <= self.config.orchestrator.max_local_prefill_length:
            return True
        if not self.registry.routable("context"):
            logger.warning("%s: no context worker is up; prefilling on a generation worker",
                           record.request_id)  # fmt: skip
            return True
        return self.context_backlogged()

    def context_backlogged(self) -> bool:
        """Load-aware prefill deflection: every context worker holds `max_prefill_queue_size`
        prefills or more, and some generation worker has fewer prompts waiting than the
        shortest of those queues. Disaggregation keeps prefills out of the decode steps, but
        once the context workers are the bottleneck a prompt queued there only waits, where
        the generation workers' memory-bound steps could carry its chunks beside their
        decodes; comparing the queues sends it where it starts sooner (a burst of prompts is
        dealt out between both sides, not all to one).

        Where the decode steps are the bottleneck it costs throughput instead, and a queue of
        a few prompts shows up either way. "auto" tells the two apart by the time requests
        spend on each side (orchestrator/stage_balance.py): it deflects only while prompts wait
        clearly longer for their first token than they then take to decode."""
        limit = self.config.orchestrator.max_prefill_queue_size
        if limit == 0:
            return False
        # a context worker's request_ids are its prefills: each leaves it at PrefillDone
        shortest = min(len(w.request_ids) for w in self.registry.routable("context"))
        if shortest < (AUTO_PREFILL_QUEUE_SIZE if limit == "auto" else limit):
            return False
        waiting = (
            w.stats.num_waiting + w.local_prefills_unreported
            for w in self.registry.routable("generation")
        )
        if min(waiting) >= shortest:
            return False
        return limit != "auto" or self.stage_balance.context_bound()

    def start_prefill(self, record: RequestRecord, out: Outbox) -> None:
        workers = self.registry.routable("context")
        worker = self.context_router.pick(
            workers, self.hashes(record), record.request.conversation_id
        )
        record.state = State.PREFILLING
        record.prefill_attempts += 1
        self.assign(record, worker, "context_worker")
        prefill = PrefillRequest(
            request=record.engine,
            postproc_address=record.postproc_address,
            postproc_start=record.postproc_start,
            tier_peer=self.tier_peer(worker, workers, record),
        )
        out.append((worker.worker_id.encode(), prefill))

    def on_prefill_done(self, done: PrefillDone, now: float, out: Outbox) -> None:
        record = self.requests.get(done.request_id)
        if record is None or record.state is not State.PREFILLING:
            return  # aborted meanwhile: the context worker was told to abort too
        self.release(record, "context_worker")
        # from the cluster's receipt, routing and a retried prefill included; the lease (a
        # duration) goes on as it came: the decode request leaves now
        done.times.first_token_s = now - record.received_at
        self.stage_balance.prefilled(done.times.first_token_s)
        if done.finished:
            self.end(done.request_id)  # the context worker sent the tokens to postproc itself
            return
        record.handed_off_at = now
        self.start_decode(record, done, out)

    def on_finished(self, finished: RequestFinished, now: float) -> None:
        record = self.requests.get(finished.request_id)
        if record is not None and record.handed_off_at:
            self.stage_balance.decoded(now - record.handed_off_at)
        if self.end(finished.request_id) is not None:
            logger.debug(
                "%s finished (%s): %d tokens; KV pulled: %d bytes in %.2f ms",
                finished.request_id,
                finished.finish_reason,
                finished.num_output_tokens,
                finished.transfer_num_bytes,
                finished.transfer_seconds * 1e3,
            )

    def start_decode(self, record: RequestRecord, prefill: PrefillDone | None, out: Outbox) -> None:
        workers = self.registry.routable("generation")
        if not workers:
            failed = self.failure(record.request_id, 503, NO_DECODER)
            self.fail(record.request_id, failed, out)
            return
        worker = self.generation_router.pick(
            workers, self.hashes(record), record.request.conversation_id
        )
        record.state = State.DECODING
        self.assign(record, worker, "generation_worker")
        if prefill is None:
            worker.local_prefills_routed += 1
            worker.local_prefills_unreported += 1
        decode = DecodeRequest(
            # a pulled prompt's images stay where it was prefilled: their digests go on
            request=record.engine if prefill is None else record.engine.without_pixels(),
            postproc_address=record.postproc_address,
            postproc_start=record.postproc_start,
            prefill=prefill,
        )
        out.append((worker.worker_id.encode(), decode))

    def tier_peer(
        self, worker: WorkerRecord, workers: Sequence[WorkerRecord], record: RequestRecord
    ) -> str | None:
        """The NIXL agent of a context worker whose host tier holds more of the prompt than
        `worker` does (engine/kv_tier_share.py), or None."""
        if not self.config.kv_cache.offload.enabled:
            return None
        others = (w.worker_id for w in workers if w is not worker)
        peer_id = self.prefix_index.tier_peer(worker.worker_id, others, self.hashes(record))
        peer = self.registry.workers.get(peer_id) if peer_id is not None else None
        return peer.kv_pool.agent_name if peer is not None and peer.kv_pool else None

    @staticmethod
    def hashes(record: RequestRecord) -> list[int]:
        """The prompt's block hashes, as the frontend computed them (kv_aware only)."""
        return record.request.prompt_block_hashes

    def assign(self, record: RequestRecord, worker: WorkerRecord, slot: str) -> None:
        setattr(record, slot, worker)
        worker.active_tokens += record.load
        worker.request_ids.add(record.request_id)
        worker.requests_routed += 1

    def release(self, record: RequestRecord, slot: str) -> None:
        worker: WorkerRecord | None = getattr(record, slot)
        if worker is not None and record.request_id in worker.request_ids:
            worker.active_tokens -= record.load
            worker.request_ids.discard(record.request_id)

    # --- endings ----------------------------------------------------------------------------------

    def end(self, request_id: str) -> RequestRecord | None:
        record = self.requests.pop(request_id, None)
        if record is not None:
            self.release(record, "context_worker")
            self.release(record, "generation_worker")
        return record

    def fail(self, request_id: str, failed: RequestFailed, out: Outbox) -> None:
        """Tell the frontend, and have every worker that holds something of the request drop
        it: the postproc worker its state (no worker will send it the request's end now), the
        context worker its prefill or lease, the generation worker its decode. The one that
        reported the failure has dropped it already; an Abort for nothing is a no-op."""
        record = self.end(request_id)
        if record is None:
            return
        out.append((record.frontend, failed))
        abort = Abort(request_id=request_id, reason="error")
        if record.postproc_worker_id:
            out.append((record.postproc_worker_id.encode(), abort))
        for worker in (record.context_worker, record.generation_worker):
            if worker is not None:
                out.append((worker.worker_id.encode(), abort))

    def abort(self, request_id: str, out: Outbox) -> None:
        record = self.end(request_id)
        if record is None:
            return
        worker = (
            record.context_worker if record.state is State.PREFILLING else record.generation_worker
        )
        if worker is not None:
            out.append((worker.worker_id.encode(), Abort(request_id=request_id)))

    def worker_lost(self, worker: WorkerRecord, out: Outbox) -> None:
        """A worker died (or restarted without its state): deal with every request it held."""
        lost = [r for r in self.requests.values() if self.touches(r, worker)]
        for record in lost:
            if worker.role == "context" and record.state is State.PREFILLING:
                self.release(record, "context_worker")
                if record.prefill_attempts < MAX_PREFILL_ATTEMPTS:
                    logger.warning("%s: retrying its prefill elsewhere", record.request_id)
                    if self.prefills_locally(record):
                        self.start_decode(record, None, out)
                    else:
                        self.start_prefill(record, out)
                    continue
            message = f"the {worker.role} worker serving this request stopped ({worker.worker_id})"
            self.fail(record.request_id, self.failure(record.request_id, 503, message), out)
        worker.request_ids.clear()
        worker.active_tokens = 0
        self.prefix_index.forget(worker.worker_id)

    @staticmethod
    def touches(record: RequestRecord, worker: WorkerRecord) -> bool:
        if worker.role == "postproc":
            return record.postproc_address == worker.address
        if worker.role == "context":  # after the hand-off, a failed READ is the reader's to report
            return record.state is State.PREFILLING and record.context_worker is worker
        return record.generation_worker is worker

    @staticmethod
    def failure(request_id: str, status_code: int, message: str) -> RequestFailed:
        codes = {503: "service_unavailable", 429: "rate_limited"}
        code = codes.get(status_code, "invalid_request")
        return RequestFailed(
            request_id=request_id, status_code=status_code, message=message, code=code
        )
