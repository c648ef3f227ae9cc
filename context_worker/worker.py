"""The context worker's loop: prefill requests, sample each choice's first token, and lease the
prompt's blocks to the generation worker that will read them over NIXL.

Socket-free (common/worker_process.py drives it): `handle()` takes commands; one `step()` frees
the leases whose blocks were read (or expired), runs one engine step, and answers each request
whose first tokens are all sampled with a PrefillDone. Both return what to send.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from common.config import ClusterConfig
from common.errors import InvalidRequest
from common.protocol import (
    Abort,
    LoRACommand,
    Message,
    PrefillDone,
    PrefillRequest,
    Profile,
    ProfileDone,
    Registered,
    RequestFailed,
    TokenBatch,
    TokenDelta,
    WorkerStats,
    decode_token_ids,
)
from common.stage_times import StageTimes
from common.worker_process import ORCHESTRATOR, EngineFault, Outbox
from context_worker.leases import LeaseTable
from engine.kv_tier_share import TierShare
from engine.kv_transfer import KVTransferAgent
from engine.llm_engine import LLMEngine, TokenOutput
from engine.lora.commands import apply_lora_command
from engine.profiling import EngineProfiler
from engine.prompt_images import pixels_of
from engine.worker_bridge import kv_events, to_delta, worker_stats

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 5  # NIXL notifications do not wake a zmq poll: bound their latency


@dataclass(slots=True)
class Prefilling:
    """A request prefilling here, until every choice has its first token."""

    prefill: PrefillRequest
    received_at: float  # the worker's clock
    first: list[TokenDelta] = field(default_factory=list)  # the choices' first tokens so far

    @property
    def request_id(self) -> str:
        return self.prefill.request.request_id

    @property
    def num_first_tokens(self) -> int:
        """How many first tokens complete it (a beam search: one offer)."""
        sampling = self.prefill.request.sampling
        return 1 if sampling.beam else sampling.n


class ContextWorker:
    """`agent`: the NIXL agent over the engine's KV pool (readers' notifications free leases);
    `clock`: what the worker reads the time from (time.monotonic; tests pass their own);
    `tier_share`: reads other context workers' host offload tiers (kv_cache.offload on)."""

    def __init__(
        self,
        config: ClusterConfig,
        worker_id: str,
        engine: LLMEngine,
        agent: KVTransferAgent,
        clock: Callable[[], float] = time.monotonic,
        tier_share: TierShare | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.engine, self.agent = engine, agent
        self.tier_share = tier_share
        self.clock = clock
        self.leases = LeaseTable(config.transfer.lease_seconds)
        self.prefilling: dict[str, Prefilling] = {}
        self.profiler = EngineProfiler(
            config.profiler.dir, worker_id, config.device, config.profiler.max_steps
        )
        self.out: Outbox = []  # what the current handle() / step() sends

    def stats(self) -> WorkerStats:
        stats = worker_stats(self.engine, len(self.prefilling) + len(self.leases))
        if self.tier_share is not None:
            stats.kv_offload_peer_blocks_read = self.tier_share.num_blocks_read
            stats.kv_offload_peer_read_failures = self.tier_share.num_failed_reads
        return stats

    def wait_ms(self) -> int:
        return 0 if self.engine.has_unfinished() else IDLE_POLL_MS

    def handle(self, message: Message, now: float) -> Outbox:
        if isinstance(message, PrefillRequest):
            self.start(message, now)
        elif isinstance(message, Abort):
            self.abort(message.request_id)
        elif isinstance(message, Registered) and self.tier_share is not None:
            self.tier_share.sync_peers(message.peers)
        elif isinstance(message, Profile):
            self.answer_profile(self.profiler.answer(message))
        elif isinstance(message, LoRACommand):
            self.out.append(
                (ORCHESTRATOR, apply_lora_command(self.engine, self.worker_id, message))
            )
        return self.take_out()

    def step(self, now: float) -> Outbox:
        self.end_leases(now)
        if self.engine.has_unfinished():
            self.collect(self.run_engine_step())
            self.profiler.step_done()
        self.answer_profile(self.profiler.poll())
        events = kv_events(self.engine, self.worker_id)
        if events is not None:
            self.out.append((ORCHESTRATOR, events))
        return self.take_out()

    def take_out(self) -> Outbox:
        out, self.out = self.out, []
        return out

    def run_engine_step(self) -> list[TokenOutput]:
        """One engine step. One that raises leaves the engine's state untrustworthy: every
        prefill in progress fails now with a 500 and the process exits for the supervisor to
        start a clean one (the seed's executor-fault boundary, EngineFault); a reader of one of
        its leases finds its source gone and prefills the prompt itself
        (transfer.recompute_on_failure)."""
        try:
            return self.engine.step()
        except Exception:
            logger.exception("engine step failed: failing %d prefills; exiting to be restarted",
                             len(self.prefilling))  # fmt: skip
            for request_id in list(self.prefilling):
                self.fail(request_id, "the context worker failed and is restarting", None, 500)
            raise EngineFault(self.take_out()) from None

    def start(self, prefill: PrefillRequest, now: float) -> None:
        request = prefill.request
        try:
            prompt = decode_token_ids(request.prompt_token_ids_b64)
            if prefill.tier_peer is not None and self.tier_share is not None:
                # a peer's tier holds more of the prompt: its blocks join this worker's tier,
                # which the engine's prefix lookup restores from (nothing on failure: computed)
                num_read = self.tier_share.fetch_prompt(
                    prefill.tier_peer, self.engine.kv, prompt, request.extra_keys
                )
                logger.info("%s: %d prompt blocks read from %s's host tier",
                            request.request_id, num_read, prefill.tier_peer)  # fmt: skip
            self.engine.add_request(
                request.request_id,
                prompt,
                request.sampling,
                request.extra_keys,
                prefill_only=True,
                priority=request.priority,
                images=pixels_of(request.images, self.engine.model_config.vision),
            )
        except InvalidRequest as e:
            self.fail(request.request_id, str(e), e.param)
            return
        except ValueError as e:
            self.fail(request.request_id, str(e), "prompt")
            return
        self.prefilling[request.request_id] = Prefilling(prefill, received_at=now)

    def fail(
        self, request_id: str, message: str, param: str | None, status_code: int = 400
    ) -> None:
        failed = RequestFailed(
            request_id=request_id,
            status_code=status_code,
            message=message,
            code="invalid_request" if status_code == 400 else "internal_error",
            param=param,
        )
        self.out.append((ORCHESTRATOR, failed))

    def collect(self, outputs: list[TokenOutput]) -> None:
        for out in outputs:
            prefilling = self.prefilling.get(out.request_id)
            if prefilling is None:
                continue
            prefilling.first.append(to_delta(out))
            if len(prefilling.first) == prefilling.num_first_tokens:
                times = StageTimes(
                    queue_s=out.queue_s,
                    prefill_s=out.run_s,
                    first_token_s=self.clock() - prefilling.received_at,
                )
                self.finish(prefilling, times)

    def finish(self, prefilling: Prefilling, times: StageTimes) -> None:
        """Lease the prompt's blocks to a reader, or, when the first tokens already end every
        choice, free them and hand the tokens to the postproc worker directly."""
        request_id, prefill = prefilling.request_id, prefilling.prefill
        del self.prefilling[request_id]
        first = sorted(prefilling.first, key=lambda d: d.index)
        done = PrefillDone(
            request_id=request_id,
            worker_id=self.worker_id,
            agent_name=self.agent.name,
            first=first,
            times=times,
        )
        if done.finished:
            self.engine.release_held(request_id)
            for delta in first:
                delta.times = times
            batch = TokenBatch(deltas=first, starts=[prefill.postproc_start])
            self.out.append((prefill.postproc_address, batch))
        else:
            done.block_ids = self.engine.held_block_table(request_id)
            self.leases.add(request_id, self.clock())
            done.lease_s = self.leases.lease_s
        self.out.append((ORCHESTRATOR, done))

    def end_leases(self, now: float) -> None:
        for _peer, note in self.agent.take_notifications():
            request_id = note.decode(errors="replace")
            if self.leases.release(request_id):
                self.engine.release_held(request_id)
        for request_id in self.leases.expired(now):
            logger.warning("%s: lease expired before its KV was read; blocks freed", request_id)
            self.engine.release_held(request_id)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)  # frees held blocks too
        self.prefilling.pop(request_id, None)
        self.leases.release(request_id)

    def idle(self, now: float) -> bool:
        """Nothing to finish: no prefill running, no lease a reader may still need."""
        return not self.prefilling and not self.leases and not self.engine.has_unfinished()

    def answer_profile(self, done: ProfileDone | None) -> None:
        if done is not None:
            self.out.append((ORCHESTRATOR, done))

    def close(self) -> None:
        self.profiler.close()
        if self.tier_share is not None:
            self.tier_share.close()
        self.agent.close()
