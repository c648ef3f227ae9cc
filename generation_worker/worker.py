"""The generation worker's loop: admit decode requests, pull their prompt's KV from the context
worker over NIXL, decode them in one continuous batch, and push each step's tokens to the
requests' postproc workers.

Socket-free (common/worker_process.py drives it): `handle()` takes commands; one `step()` starts
pulls while there is room, settles finished pulls, runs one engine step and flushes the step's
TokenBatches. Both return what to send.
"""

from __future__ import annotations

import bisect
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from common.config import ClusterConfig
from common.errors import InvalidRequest
from common.protocol import (
    FAILED,
    Abort,
    DecodeRequest,
    FinishReason,
    KVPool,
    LoRACommand,
    Message,
    PeersRequest,
    PrefillDone,
    Profile,
    ProfileDone,
    Registered,
    RequestFailed,
    RequestFinished,
    TokenBatch,
    TokenDelta,
    WorkerStats,
    decode_token_ids,
)
from common.stage_times import StageTimes
from common.worker_process import ORCHESTRATOR, EngineFault, Outbox
from engine.kv_transfer import KVTransferAgent, KVTransferError
from engine.llm_engine import LLMEngine, TokenOutput
from engine.lora.commands import apply_lora_command
from engine.profiling import EngineProfiler
from engine.prompt_images import pixels_of
from engine.worker_bridge import kv_events, to_delta, worker_stats
from generation_worker.arrival import ArrivalBound
from generation_worker.pulls import Pull, plan_read

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 5
LEASE_MARGIN_S = 0.5  # a READ must finish this long before the source's lease ends
MIN_READ_S = 1.0  # a waiting decode with less lease than margin + this is prefilled here instead
PEERS_REQUEST_INTERVAL_S = 1.0


@dataclass(slots=True)
class ActiveRequest:
    decode: DecodeRequest
    unfinished: set[int]  # choices still decoding
    announced: bool = False  # its postproc worker has been sent the PostprocStart
    num_output_tokens: int = 0
    transfer_num_bytes: int = 0
    transfer_seconds: float = 0.0
    pending: list[TokenDelta] = field(default_factory=list)
    received_at: float = 0.0  # the worker's clock
    lease_deadline: float = math.inf  # when the source may reuse the prompt's blocks, our clock
    times: StageTimes = field(default_factory=StageTimes)  # the stages up to the first token
    started: set[int] = field(default_factory=set)  # choices that have had an output here
    _prompt: list[int] | None = None

    @property
    def request_id(self) -> str:
        return self.decode.request.request_id

    @property
    def prompt(self) -> list[int]:
        """The prompt's token ids, decoded from the wire once; ValueError when malformed."""
        if self._prompt is None:
            self._prompt = decode_token_ids(self.decode.request.prompt_token_ids_b64)
        return self._prompt


def first_tokens(prefill: PrefillDone) -> dict[int, int]:
    """Each unfinished choice's first token (none for a beam search: its offer came instead)."""
    first = prefill.first
    return {d.index: d.token_ids[0] for d in first if d.finish_reason is None and d.token_ids}


class GenerationWorker:
    """`agent`: the NIXL agent that reads context workers' KV into the engine's pool; `clock`:
    what the worker reads the time from (time.monotonic; tests pass their own)."""

    def __init__(
        self,
        config: ClusterConfig,
        worker_id: str,
        engine: LLMEngine,
        agent: KVTransferAgent,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.worker_id = worker_id
        self.config = config
        self.engine, self.agent = engine, agent
        self.clock = clock
        self.max_num_seqs = config.generation_workers.max_num_seqs
        # prefilled, waiting for blocks or a slot: higher priority first, then arrival order
        self.waiting: list[DecodeRequest] = []
        self.pulls: dict[str, Pull] = {}
        self.active: dict[str, ActiveRequest] = {}
        self.batches: dict[str, TokenBatch] = {}  # postproc address -> this step's tokens
        self.out: Outbox = []  # what the current handle() / step() sends
        self.kv_bytes_pulled = 0
        self.kv_pull_seconds = 0.0
        self.kv_pull_failures = 0
        self.prompts_recomputed = 0  # handed-off prompts prefilled here: their KV was gone
        self._peers_asked_at = 0.0
        self.arrivals = ArrivalBound(clock())  # what KV leases are counted from
        self._read_at = -math.inf  # the `now` of the last read seen, and its arrival bound
        self._arrived_after = 0.0
        self.profiler = EngineProfiler(
            config.profiler.dir, worker_id, config.device, config.profiler.max_steps
        )

    def stats(self) -> WorkerStats:
        stats = worker_stats(self.engine, len(self.active), len(self.waiting) + len(self.pulls))
        stats.kv_bytes_pulled = self.kv_bytes_pulled
        stats.kv_pull_seconds = self.kv_pull_seconds
        stats.kv_pull_failures = self.kv_pull_failures
        stats.prompts_recomputed = self.prompts_recomputed
        return stats

    def wait_ms(self) -> int:
        return 0 if self.engine.has_unfinished() or self.pulls or self.waiting else IDLE_POLL_MS

    def handle(self, message: Message, now: float) -> Outbox:
        """`now`: when the read of the socket that brought `message` began."""
        if isinstance(message, DecodeRequest):
            self.accept(message, now)
        elif isinstance(message, Abort):
            self.abort(message.request_id)
        elif isinstance(message, Registered):
            self.sync_peers(message.peers)
        elif isinstance(message, Profile):
            self.answer_profile(self.profiler.answer(message))
        elif isinstance(message, LoRACommand):
            self.out.append(
                (ORCHESTRATOR, apply_lora_command(self.engine, self.worker_id, message))
            )
        return self.take_out()

    def step(self, now: float) -> Outbox:
        """`now`: when this loop's read of the socket began (the one its handle() calls had)."""
        self.arrived_after(now)  # every read counts, whether it brought messages or not
        self.start_pulls()
        self.settle_pulls()
        if self.engine.has_unfinished():
            self.emit(self.run_engine_step())
            self.profiler.step_done()
        self.flush()
        self.answer_profile(self.profiler.poll())
        events = kv_events(self.engine, self.worker_id)
        if events is not None:
            self.out.append((ORCHESTRATOR, events))
        return self.take_out()

    def take_out(self) -> Outbox:
        out, self.out = self.out, []
        return out

    def arrived_after(self, now: float) -> float:
        """What a message read by the read that began at `now` arrived no earlier than: KV
        leases are counted from it (arrival.py). One bound per read, however many messages."""
        if now != self._read_at:
            self._read_at, self._arrived_after = now, self.arrivals.read(now)
        return self._arrived_after

    def run_engine_step(self) -> list[TokenOutput]:
        """One engine step. One that raises leaves the engine's state (block tables, the batch,
        READs into its blocks) untrustworthy: every request this worker holds fails now with a
        500, and the process exits for the supervisor to start a clean one (the seed's
        executor-fault boundary, EngineFault). A request's own bad input is refused at
        admission instead, failing only that request."""
        try:
            return self.engine.step()
        except Exception:
            logger.exception("engine step failed: failing all %d requests; exiting to be "
                             "restarted", len(self.active))  # fmt: skip
            for active in list(self.active.values()):
                message = "the generation worker failed and is restarting"
                self.out.append((ORCHESTRATOR, RequestFailed(request_id=active.request_id,
                    status_code=500, message=message, code="internal_error")))  # fmt: skip
            raise EngineFault(self.take_out()) from None

    def sync_peers(self, pools: list[KVPool]) -> None:
        """Load each context worker's pool once (not per request); forget the departed."""
        known = set(self.agent.peer_names)
        listed = {pool.agent_name for pool in pools}
        for pool in pools:
            if pool.agent_name not in known:
                try:
                    self.agent.add_peer(pool)
                    logger.info("added NIXL peer %s", pool.agent_name)
                except KVTransferError as e:
                    logger.error("cannot read KV from %s: %s", pool.agent_name, e)
        in_use = {p.decode.prefill.agent_name for p in self.pulls.values() if p.decode.prefill}
        for name in known - listed - in_use:
            self.agent.remove_peer(name)

    # --- admission --------------------------------------------------------------------------------

    def accept(self, decode: DecodeRequest, now: float) -> None:
        """Decode it; a prefilled one first waits for a slot and blocks to pull its KV into,
        before its lease (counted from no later than its arrival) runs out."""
        request = decode.request
        if request.request_id in self.active:
            return  # a duplicate delivery
        prefill = decode.prefill
        if prefill is None:
            active = ActiveRequest(decode, set(range(request.sampling.n)), received_at=now)
            self.active[request.request_id] = active
            try:
                self.engine.add_request(
                    request.request_id,
                    active.prompt,
                    request.sampling,
                    request.extra_keys,
                    priority=request.priority,
                    images=pixels_of(request.images, self.engine.model_config.vision),
                )
            except (InvalidRequest, ValueError) as e:
                self.fail(active, 400, str(e), getattr(e, "param", "prompt"))
            return
        beam_search = request.sampling.beam is not None
        active = ActiveRequest(
            decode,
            set(range(request.sampling.n))
            if beam_search  # its choices are known at the end
            else {d.index for d in prefill.first if d.finish_reason is None},
            received_at=now,
            lease_deadline=self.arrived_after(now) + prefill.lease_s
            if prefill.lease_s
            else math.inf,
            times=prefill.times,
        )
        self.active[request.request_id] = active
        if not beam_search:
            for delta in prefill.first:
                delta.times = prefill.times
            self.queue(active, prefill.first)  # the first tokens go out before the pull
        bisect.insort_right(self.waiting, decode, key=lambda d: -d.request.priority)

    def start_pulls(self) -> None:
        """Post READs, by priority then arrival, while decode slots and blocks allow. A waiting
        decode whose lease runs out first is prefilled here (its KV is about to be freed): more
        requests than slots all complete. One whose source this worker does not know waits
        while the peer set is asked for again."""
        still_waiting: list[DecodeRequest] = []
        blocked = False
        for decode in self.waiting:
            assert decode.prefill is not None
            if self.lease_left_s(decode) < LEASE_MARGIN_S + MIN_READ_S:
                self.prefill_here(decode)
            elif blocked or len(self.pulls) + self.engine.num_running >= self.max_num_seqs:
                still_waiting.append(decode)
            elif decode.prefill.agent_name not in self.agent.peer_names:
                self.ask_for_peers()
                still_waiting.append(decode)
            elif not self.start_pull(decode):
                blocked = True  # no free blocks now; retry next step, in order
                still_waiting.append(decode)
        self.waiting = still_waiting

    def prefill_here(self, decode: DecodeRequest) -> None:
        request, prefill = decode.request, decode.prefill
        assert prefill is not None
        logger.info("%s: its KV on %s is not readable in time; prefilling it here",
                    request.request_id, prefill.agent_name)  # fmt: skip
        self.release_source(decode)
        active = self.active[request.request_id]
        if self.engine.needs_images(active.prompt):  # its pixels stayed on the context worker
            self.fail(active, 503, "the prompt's KV was not read in time, and its images are "
                      "not here to prefill it again", None, "kv_transfer_failed")  # fmt: skip
            return
        self.prompts_recomputed += 1
        try:
            self.engine.add_continued_request(
                request.request_id,
                active.prompt,
                request.sampling,
                first_tokens(prefill),
                request.extra_keys,
                priority=request.priority,
            )
        except (InvalidRequest, ValueError) as e:
            self.fail(active, 400, str(e), getattr(e, "param", "prompt"))

    def ask_for_peers(self) -> None:
        now = self.clock()
        if now - self._peers_asked_at >= PEERS_REQUEST_INTERVAL_S:
            self._peers_asked_at = now
            self.out.append((ORCHESTRATOR, PeersRequest(worker_id=self.worker_id)))

    def start_pull(self, decode: DecodeRequest) -> bool:
        """Allocate blocks and post the READ; False (nothing changed) when blocks are short."""
        request, prefill = decode.request, decode.prefill
        assert prefill is not None
        active = self.active[request.request_id]
        try:
            planned = self.engine.add_pulled_request(
                request.request_id,
                active.prompt,
                request.sampling,
                first_tokens(prefill),
                prefill.first[0].num_cached_tokens,
                request.extra_keys,
                priority=request.priority,
                beam_candidates=prefill.first[0].beam_candidates,
            )
        except (InvalidRequest, ValueError) as e:
            self.release_source(decode)
            self.fail(active, 400, str(e), getattr(e, "param", "prompt"))
            return True
        if planned is None:
            return False
        active.times = msgspec.structs.replace(
            active.times, queue_s=active.times.queue_s + self.clock() - active.received_at
        )  # its wait here for a slot and blocks
        table, num_valid = planned
        notification = request.request_id.encode()
        try:
            plan = plan_read(prefill.block_ids, table, num_valid, self.engine.block_size)
            if plan.remote_block_ids:
                handle = self.agent.start_read(
                    prefill.agent_name,
                    plan.remote_block_ids,
                    plan.local_block_ids,
                    notification,
                    self.read_timeout_s(decode),
                )
            else:
                self.agent.notify(prefill.agent_name, notification)
                handle = None
        except (KVTransferError, ValueError) as e:
            self.pulls[request.request_id] = Pull(decode, None)
            self.pull_failed(request.request_id, str(e))
            return True
        self.pulls[request.request_id] = Pull(decode, handle)
        return True

    def lease_left_s(self, decode: DecodeRequest) -> float:
        """Seconds until the context worker may reuse the blocks (no lease: unbounded)."""
        return self.active[decode.request.request_id].lease_deadline - self.clock()

    def read_timeout_s(self, decode: DecodeRequest) -> float:
        """How long a READ may take: never past the source's lease (with a margin), since the
        blocks may be reused after it. Raises when the lease is (nearly) over already."""
        left_s = self.lease_left_s(decode) - LEASE_MARGIN_S
        if left_s <= 0:
            raise KVTransferError("the context worker's lease ran out before the read")
        return min(self.config.transfer.pull_timeout_seconds, left_s)

    def settle_pulls(self) -> None:
        for request_id, pull in list(self.pulls.items()):
            handle = pull.handle
            state = "done" if handle is None else self.agent.poll(handle)
            if state == "pending":
                continue
            if handle is not None:
                self.agent.release(handle)
            if state == "done":
                del self.pulls[request_id]
                if handle is not None and handle.seconds is not None:
                    self.record_transfer(self.active[request_id], handle.num_bytes, handle.seconds)
                self.emit(self.engine.pull_done(request_id))
            else:
                self.pull_failed(request_id, handle.error if handle else "unknown error")

    def record_transfer(self, active: ActiveRequest, num_bytes: int, seconds: float) -> None:
        active.transfer_num_bytes += num_bytes
        active.transfer_seconds += seconds
        self.kv_bytes_pulled += num_bytes
        self.kv_pull_seconds += seconds

    def pull_failed(self, request_id: str, error: str | None) -> None:
        """The READ failed or timed out (and is cancelled): recompute here, or fail the request."""
        pull = self.pulls.pop(request_id)
        self.kv_pull_failures += 1
        recompute = self.config.transfer.recompute_on_failure and not self.engine.needs_images(
            self.active[request_id].prompt
        )  # a prompt's images stay with the context worker that prefilled it
        source = pull.decode.prefill.agent_name if pull.decode.prefill else "?"
        logger.warning(
            "%s: KV pull from %s failed (%s); %s",
            request_id,
            source,
            error,
            "recomputing the prompt here" if recompute else "failing the request",
        )
        self.engine.pull_failed(request_id, recompute)
        self.release_source(pull.decode)
        if recompute:
            self.prompts_recomputed += 1
        else:
            self.fail(
                self.active[request_id],
                503,
                f"KV transfer from the context worker failed: {error}",
                None,
                "kv_transfer_failed",
            )

    def release_source(self, decode: DecodeRequest) -> None:
        """Tell the context worker it may free its lease now (nothing more will be read)."""
        if decode.prefill is None or decode.prefill.finished:
            return
        try:
            self.agent.notify(decode.prefill.agent_name, decode.request.request_id.encode())
        except KVTransferError:
            pass  # the source is gone or unknown: its lease expires by itself

    # --- output -----------------------------------------------------------------------------------

    def emit(self, outputs: list[TokenOutput]) -> None:
        now = self.clock()
        for out in outputs:
            active = self.active.get(out.request_id)
            if active is None:
                continue
            self.queue(active, [self.timed_delta(active, out, now)])
            if out.finish_reason is not None:
                active.unfinished.discard(out.index)
                if not active.unfinished:
                    self.finish(active, out.finish_reason)

    def timed_delta(self, active: ActiveRequest, out: TokenOutput, now: float) -> TokenDelta:
        """The output as a delta; a choice's first token (prefilled here) carries the stages up
        to it, its last every stage."""
        delta = to_delta(out)
        prefilled_here = active.decode.prefill is None
        if prefilled_here and out.index not in active.started:
            active.times = StageTimes(
                queue_s=out.queue_s, prefill_s=out.run_s, first_token_s=now - active.received_at
            )
            delta.times = active.times
        active.started.add(out.index)
        if out.finish_reason is not None:
            decode_s = out.run_s - (active.times.prefill_s if prefilled_here else 0.0)
            delta.times = msgspec.structs.replace(
                active.times, transfer_s=active.transfer_seconds, decode_s=max(decode_s, 0.0)
            )
        return delta

    def queue(self, active: ActiveRequest, deltas: list[TokenDelta]) -> None:
        """Add deltas to this step's batch for the request's postproc worker."""
        address = active.decode.postproc_address
        batch = self.batches.setdefault(address, TokenBatch(deltas=[]))
        if not active.announced:
            active.announced = True
            batch.starts.append(active.decode.postproc_start)
        batch.deltas.extend(deltas)
        active.num_output_tokens += sum(len(d.token_ids) for d in deltas)

    def flush(self) -> None:
        self.out.extend(self.batches.items())
        self.batches.clear()

    def finish(self, active: ActiveRequest, reason: FinishReason) -> None:
        del self.active[active.request_id]
        finished = RequestFinished(
            request_id=active.request_id,
            worker_id=self.worker_id,
            finish_reason=reason,
            num_output_tokens=active.num_output_tokens,
            transfer_num_bytes=active.transfer_num_bytes,
            transfer_seconds=active.transfer_seconds,
        )
        self.out.append((ORCHESTRATOR, finished))

    def end(self, active: ActiveRequest, reason: FinishReason = "abort") -> None:
        """End every unfinished choice, so the postproc worker drops the request: "abort" (the
        client is gone or a stop string ended it) closes the response normally; FAILED closes
        nothing, the frontend hears of the failure from the orchestrator (an "abort" ending could
        reach it first and turn the error into a truncated 200)."""
        if active.announced:
            ends = [
                TokenDelta(active.request_id, i, [], finish_reason=reason)
                for i in sorted(active.unfinished)
            ]
            self.queue(active, ends)
        self.finish(active, reason)

    def fail(
        self,
        active: ActiveRequest,
        status_code: int,
        message: str,
        param: str | None,
        code: str = "invalid_request",
    ) -> None:
        failed = RequestFailed(
            request_id=active.request_id,
            status_code=status_code,
            message=message,
            code=code,
            param=param,
        )
        self.out.append((ORCHESTRATOR, failed))
        self.engine.abort(active.request_id)
        self.end(active, FAILED)

    def abort(self, request_id: str) -> None:
        active = self.active.get(request_id)
        if active is None:
            return
        pull = self.pulls.pop(request_id, None)
        if pull is not None and pull.handle is not None:
            self.agent.release(pull.handle)  # cancel the READ before its blocks are freed
        queued = any(d is active.decode for d in self.waiting)  # identity: no deep compare
        if queued:
            self.waiting = [d for d in self.waiting if d is not active.decode]
        if pull is not None or queued:
            self.release_source(active.decode)
        self.engine.abort(request_id)
        self.end(active)

    def idle(self, now: float) -> bool:
        """Nothing to finish: no request decoding, waiting or pulling, no output unsent."""
        return not (self.active or self.pulls or self.waiting or self.batches)

    def answer_profile(self, done: ProfileDone | None) -> None:
        if done is not None:
            self.out.append((ORCHESTRATOR, done))

    def close(self) -> None:
        self.profiler.close()
        self.agent.close()
