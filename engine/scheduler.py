"""Continuous batching with chunked prefill under a token budget, and preemption by recompute.

Each step: running sequences first (a decode token each, or the next chunk of a prefill), then
waiting sequences are admitted while the budget, `max_num_seqs` and free blocks allow. When a
running sequence cannot get a block, the most recently admitted running sequence is preempted: its
blocks are freed and it returns to the head of the queue to be recomputed later (its full blocks
usually survive in the prefix cache, so the recompute is cheap).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.kv_cache_manager import KVCacheManager
from engine.sampler import SampleResult
from engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledChunk:
    seq: Sequence
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the sequence's last token: the step yields a new token."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
    ) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._arrivals = 0

    def add(self, seq: Sequence) -> None:
        seq.arrival_order = self._arrivals
        self._arrivals += 1
        self.waiting.append(seq)

    def abort(self, request_id: str) -> list[Sequence]:
        """Finish every sequence of the request now and free its blocks."""
        aborted = [s for s in [*self.waiting, *self.running] if s.request_id == request_id]
        for seq in aborted:
            self._finish(seq, "abort")
        return aborted

    def has_request(self, request_id: str) -> bool:
        return any(s.request_id == request_id for s in [*self.waiting, *self.running])

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self._reserve(seq, num_new, out.preempted):
                break
            out.chunks.append(ScheduledChunk(seq, num_new))
            budget -= num_new
            i += 1
        if not out.preempted:
            budget = self._admit(budget, out)
        return out

    def _reserve(self, seq: Sequence, num_new: int, preempted: list[Sequence]) -> bool:
        """Find blocks for `num_new` more tokens, preempting from the tail; False if `seq` itself
        went."""
        while not self.kv.allocate_slots(seq.seq_id, seq.num_computed_tokens + num_new):
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _admit(self, budget: int, out: SchedulerOutput) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            blocks, num_cached = self.kv.get_computed_blocks(seq.token_ids, seq.extra_keys)
            num_new = min(seq.num_tokens - num_cached, budget)
            if not self.kv.allocate_slots(seq.seq_id, num_cached + num_new, blocks):
                break
            self.waiting.popleft()
            if seq.num_preemptions == 0:
                seq.num_cached_prompt_tokens = num_cached
            seq.num_computed_tokens = num_cached
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.chunks.append(ScheduledChunk(seq, num_new))
            budget -= num_new
        return budget

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def postprocess(
        self, out: SchedulerOutput, sampled_seqs: list[Sequence], sampled: SampleResult
    ) -> None:
        """Advance computed counts, register full blocks, append sampled tokens, finish stopped.

        `sampled_seqs` are the sequences in the order of the sampler's rows (the runner's order).
        """
        for chunk in out.chunks:
            seq = chunk.seq
            seq.num_computed_tokens += chunk.num_new_tokens
            self.kv.cache_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens, seq.extra_keys)
        for row, seq in enumerate(sampled_seqs):
            token_id = sampled.token_ids[row]
            seq.append_token(token_id)
            reason = self._stop_reason(seq, token_id)
            if reason is not None:
                self._finish(seq, reason)

    def _stop_reason(self, seq: Sequence, token_id: int) -> str | None:
        params = seq.params
        if token_id in params.stop_token_ids or (
            not params.ignore_eos and token_id in seq.sampling.eos_token_ids
        ):
            seq.stop_token_id = token_id
            return "stop"
        if len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.kv.free(seq.seq_id)
