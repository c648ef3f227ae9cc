"""Continuous batching with chunked prefill under a token budget, and preemption by recompute.

Each step: running sequences first (a decode token each, or the next chunk of a prefill), then
waiting sequences are admitted while the budget, `max_num_seqs` and free blocks allow. Both lists
are kept in priority order (the request's `priority`, higher first; arrival order within a level),
so the budget goes to higher priorities first. When a running sequence cannot get a block, the
last running sequence (lowest priority, most recently admitted) is preempted: its blocks are freed
and it returns to the queue, keeping its priority and its place by arrival, to be recomputed later
(its full blocks usually survive in the prefix cache, so the recompute is cheap).

Two more states serve disaggregation (see `Sequence.status`):

    context worker:     waiting ─▶ running ─(first token)─▶ held ─release_held()─▶ freed
    generation worker:  add_pulling() ─▶ pulling ─pull_done()─▶ running ─▶ finished
                                                 └pull_failed()─▶ freed, or waiting (recompute)

Held and pulling sequences own their blocks but are never scheduled; `abort` frees them too. So
do parked ones: beams that offered their continuations and wait for the rest of their group
(engine/beam_search.py); when nothing can run while beams are parked (their blocks are what is
missing), the parked beams give their blocks back and compute their offers again later.

With speculative decoding on, a decoding sequence's chunk is its last token plus up to k proposals
(`Sequence.draft_token_ids`, from a `Proposer`: engine/ngram_proposer.py or
engine/draft_proposer.py, asked once a step for every decoding sequence), when the budget and
free blocks allow (speculation never preempts). `accept_drafts` keeps the accepted proposals' KV
and rewinds the rest:

    token_ids  ... t  | d1 d2 d3        chunk of 4 computed; verdict: d1 accepted, d2 rejected
    after      ... t d1 c               c: the target's token; t, d1 computed, c to run next step
    blocks     slots of d2, d3 not counted computed; blocks past the tokens freed (trim)
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from typing import Protocol

from common.config import SpeculativeConfig
from engine.kv_cache_manager import KVCacheManager
from engine.ngram_proposer import NgramProposer
from engine.sampler import SampleResult
from engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledChunk:
    seq: Sequence
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the sequence's last token (its proposals, if any, after
        it): the step yields a new token."""
        num_known = self.num_new_tokens - len(self.seq.draft_token_ids)
        return self.seq.num_computed_tokens + num_known == self.seq.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)


class Proposer(Protocol):
    def propose(self, wanted: list[tuple[Sequence, int]]) -> list[list[int]]:
        """Up to k proposed next tokens for each (sequence, k), in one call: a draft model
        runs them as one batch."""
        ...

    def forget(self, seq_id: str) -> None:
        """The sequence finished: free what is kept for it (a draft's KV)."""
        ...


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        speculative: SpeculativeConfig | None = None,
        proposer: Proposer | None = None,  # None: speculative's n-gram lookup
        step_fill_tokens: int | None = None,  # None: max_num_batched_tokens (see schedule)
    ) -> None:
        self.kv = kv
        self.speculative = speculative
        if proposer is None and speculative is not None:
            proposer = NgramProposer(speculative.prompt_lookup_min, speculative.prompt_lookup_max)
        self.proposer = proposer
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.step_fill_tokens = step_fill_tokens or max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: list[Sequence] = []  # by Sequence.queue_key
        self.running: list[Sequence] = []  # by Sequence.queue_key
        self.held: dict[str, list[Sequence]] = {}  # request id -> its prefill-only sequences
        self.pulling: dict[str, list[Sequence]] = {}  # request id -> lead sequence + its siblings
        self.parked: dict[str, Sequence] = {}  # seq id -> a beam waiting for its group
        self._arrivals = 0
        self.prefix_queried_tokens = 0  # prompt tokens looked up in the prefix cache at admission
        self.prefix_hit_tokens = 0  # ... and found there
        self.num_admitted = 0  # first admissions, and the seconds they waited in the queue
        self.queue_seconds = 0.0

    def add(self, seq: Sequence) -> None:
        seq.arrival_time = seq.arrival_time or time.monotonic()
        seq.arrival_order = self._arrivals
        self._arrivals += 1
        _insert(self.waiting, seq)

    def abort(self, request_id: str) -> list[Sequence]:
        """Finish every sequence of the request now and free its blocks (a pulling request's
        READ must be cancelled first: its blocks are reused from here)."""
        aborted = [
            s
            for s in [*self.waiting, *self.running, *self.parked.values()]
            if s.request_id == request_id
        ]
        aborted += self.pulling.pop(request_id, [])
        for seq in aborted:
            self._finish(seq, "abort")
        self.release_held(request_id)
        return aborted

    def has_request(self, request_id: str) -> bool:
        return (
            request_id in self.held
            or request_id in self.pulling
            or any(
                s.request_id == request_id
                for s in [*self.waiting, *self.running, *self.parked.values()]
            )
        )

    def release_held(self, request_id: str) -> None:
        """Free a prefill-only request's blocks (its KV was read, or its lease ended)."""
        for seq in self.held.pop(request_id, []):
            seq.status = SequenceStatus.FINISHED
            self.kv.free(seq.seq_id)

    def add_pulling(self, seqs: list[Sequence], num_tokens: int) -> list[int] | None:
        """Allocate the lead sequence's blocks for its first `num_tokens` tokens, reusing the
        prefix cache; the KV of the rest will arrive from another worker.

        Returns the block table (its first `num_cached_tokens // block_size` blocks already hold
        valid KV; see `seqs[0].num_computed_tokens`), or None, changing nothing, when the pool is
        short. The siblings (n > 1) wait here and join the queue at pull_done.
        """
        lead = seqs[0]
        blocks, num_cached = self.kv.get_computed_blocks(lead.token_ids, lead.extra_keys)
        if not self.kv.allocate_slots(lead.seq_id, num_tokens, blocks):
            return None
        lead.num_computed_tokens = min(num_cached, num_tokens)
        self._count_lookup(num_tokens, lead.num_computed_tokens)
        for seq in seqs:
            seq.status = SequenceStatus.PULLING
        self.pulling[lead.request_id] = seqs
        return self.kv.block_table(lead.seq_id)

    def pull_done(self, request_id: str, num_tokens: int) -> None:
        """The lead's first `num_tokens` tokens now have KV: run it; siblings reuse its blocks."""
        lead, *siblings = self.pulling.pop(request_id)
        lead.num_computed_tokens = num_tokens
        self.kv.cache_blocks(lead.seq_id, lead.token_ids, num_tokens, lead.extra_keys)
        lead.arrival_order = self._arrivals
        self._arrivals += 1
        lead.status = SequenceStatus.RUNNING
        lead.admitted_at = time.monotonic()  # its pull was its wait
        _insert(self.running, lead)
        for seq in siblings:
            self.add(seq)

    def pull_failed(self, request_id: str, recompute: bool) -> list[Sequence]:
        """The READ failed (and was cancelled): free the blocks and either queue the sequences
        to prefill here (`recompute`) or finish them with reason "abort"; returns them."""
        seqs = self.pulling.pop(request_id)
        self.kv.free(seqs[0].seq_id)
        for seq in seqs:
            seq.num_computed_tokens = 0
            if recompute:
                seq.status = SequenceStatus.WAITING
                self.add(seq)
            else:
                seq.status = SequenceStatus.FINISHED
                seq.finish_reason = "abort"
        return seqs

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.parked)

    def park(self, seq: Sequence) -> None:
        """A beam has offered its continuations: out of the batch, blocks kept."""
        self.running.remove(seq)
        seq.status = SequenceStatus.PARKED
        self.parked[seq.seq_id] = seq

    def resume(self, seq: Sequence) -> None:
        """A beam continues: back in the batch, or in the queue when it has no KV (forked
        without a free block, or unparked for lack of blocks) and must compute its tokens."""
        self.parked.pop(seq.seq_id, None)
        if seq.num_computed_tokens:
            seq.status = SequenceStatus.RUNNING
            _insert(self.running, seq)
        else:
            seq.status = SequenceStatus.WAITING
            _insert(self.waiting, seq)

    def discard(self, seq: Sequence) -> None:
        """A beam that no continuation chose: its blocks are freed."""
        self._finish(seq, "abort")

    def hold(self, seq: Sequence) -> None:
        self._hold(seq, None)

    def schedule(self) -> SchedulerOutput:
        """This step's chunks: the running sequences' (decodes, and prompts part way through
        their prefill) in queue order, then admissions, within max_num_batched_tokens.

        A prompt chunk starts only while the step holds fewer than step_fill_tokens prompt
        tokens (decodes do not count: they never keep a prompt from starting); the chunk that
        crosses it is not cut there but runs on up to max_num_batched_tokens. Prompts that
        arrive together still get their first tokens one step after another (a few short ones
        a step), while one long prompt is not split into small chunks, each of which reads all
        the weights again (Qwen3-0.6B, a 1,365-token prompt in one step: 1.98 s, in chunks of
        512: 2.38 s on the Xeon host, bench/README.md)."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        # never below the budget left when the fill is the budget (or more): then no change
        prompt_room = self.step_fill_tokens
        drafts = self._drafts()
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            left = seq.num_tokens - seq.num_computed_tokens
            if left > 1 and prompt_room <= 0:  # a prompt part way: on in the next step
                i += 1
                continue
            num_new = min(left, budget)
            if left > 1:
                prompt_room -= num_new
            if seq.seq_id in drafts:
                seq.draft_token_ids = self._fit(seq, drafts[seq.seq_id], budget - 1)
                num_new += len(seq.draft_token_ids)
            if not self._reserve(seq, num_new, out.preempted):
                break
            out.chunks.append(ScheduledChunk(seq, num_new))
            budget -= num_new
            i += 1
        if not out.preempted:
            budget = self._admit(budget, prompt_room, out)
        if not out.chunks and self.parked:
            self._unpark_all()
            self._admit(budget, prompt_room, out)
        return out

    def _drafts(self) -> dict[str, list[int]]:
        """This step's proposals by sequence id: none when speculation is off, or the batch is at
        its disable_by_batch_size."""
        spec, proposer = self.speculative, self.proposer
        if spec is None or proposer is None:
            return {}
        limit = spec.disable_by_batch_size
        if limit is not None and len(self.running) >= limit:
            return {}
        wanted = [(seq, k) for seq in self.running if (k := self._room(seq, spec)) > 0]
        if not wanted:
            return {}
        proposals = proposer.propose(wanted)
        return {seq.seq_id: p for (seq, _), p in zip(wanted, proposals, strict=True) if p}

    def _room(self, seq: Sequence, spec: SpeculativeConfig) -> int:
        """How many proposals a sequence may have: 0 unless it is decoding (its last token is
        all it has to run) and speculates (not a beam, a thinking budget, a prefill-only or an
        embedding request); else within its max_tokens and the context length."""
        if (
            seq.num_tokens - seq.num_computed_tokens != 1
            or seq.beam is not None
            or seq.prefill_only
            or seq.sampling.thinking is not None
            or seq.params.embed
        ):
            return 0
        return min(
            spec.num_speculative_tokens,
            seq.params.max_tokens - len(seq.output_token_ids) - 1,  # room for the target's token
            self.max_model_len - seq.num_tokens - 1,
        )

    def _fit(self, seq: Sequence, draft: list[int], room: int) -> list[int]:
        """The proposals this step takes: within `room` more tokens of the step's budget, cut
        before the first token the grammar (if any) forbids, their blocks allocated; [] when the
        blocks are not free. A forbidden proposal could never be accepted, and every position
        verified must have a grammar state to be masked by."""
        draft = draft[:room]
        if draft and seq.sampling.matcher is not None:
            draft = draft[: seq.sampling.matcher.validate_tokens(draft)]
        if draft and not self.kv.allocate_slots(
            seq.seq_id, seq.num_computed_tokens + 1 + len(draft)
        ):
            return []
        return draft

    def _unpark_all(self) -> None:
        """Nothing could run: the parked beams' blocks are what the rest of their groups need.
        They go back to the queue, to compute their offers again."""
        for seq in self.parked.values():
            self.kv.free(seq.seq_id)
            seq.num_computed_tokens = 0
            assert seq.beam is not None
            seq.beam.forget(seq)
            seq.status = SequenceStatus.WAITING
            _insert(self.waiting, seq)
        self.parked.clear()

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

    def _admit(self, budget: int, prompt_room: int, out: SchedulerOutput) -> int:
        while (
            self.waiting and budget > 0 and prompt_room > 0
            and len(self.running) < self.max_num_seqs
        ):  # fmt: skip
            seq = self.waiting[0]
            blocks, num_cached = self.kv.get_computed_blocks(seq.token_ids, seq.extra_keys)
            if seq.wants_prompt_logprobs:  # every prompt position must run through the model
                blocks, num_cached = [], 0
            num_new = min(seq.num_tokens - num_cached, budget)
            if not self.kv.allocate_slots(seq.seq_id, num_cached + num_new, blocks):
                break
            self.waiting.pop(0)
            if not seq.admitted_at:
                seq.admitted_at = time.monotonic()
                seq.queue_s = seq.admitted_at - seq.arrival_time
            if not seq.output_token_ids:  # a first admission, not a recompute or a pulled request
                seq.num_cached_prompt_tokens = num_cached
                self._count_lookup(seq.num_prompt_tokens, num_cached)
                self.num_admitted += 1
                self.queue_seconds += seq.queue_s
            seq.num_computed_tokens = num_cached
            seq.status = SequenceStatus.RUNNING
            _insert(self.running, seq)
            out.chunks.append(ScheduledChunk(seq, num_new))
            budget -= num_new
            prompt_room -= num_new
        return budget

    def _count_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queried_tokens += num_prompt_tokens
        self.prefix_hit_tokens += num_hit_tokens

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.draft_token_ids = []
        seq.status = SequenceStatus.WAITING
        _insert(self.waiting, seq)  # its old arrival: ahead of its level's later arrivals

    def postprocess(
        self, out: SchedulerOutput, sampled_seqs: list[Sequence], sampled: SampleResult
    ) -> None:
        """Advance computed counts, register full blocks, append sampled tokens, finish stopped.

        `sampled_seqs` are the sequences in the order of the sampler's rows (the runner's order).
        """
        for chunk in out.chunks:
            seq = chunk.seq
            # proposals count as computed only once accepted (accept_drafts)
            seq.num_computed_tokens += chunk.num_new_tokens - len(seq.draft_token_ids)
            self.kv.cache_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens, seq.extra_keys)
        for row, seq in enumerate(sampled_seqs):
            token_id = sampled.token_ids[row]
            seq.append_token(token_id)
            reason = self._stop_reason(seq, token_id)
            if seq.prefill_only:
                self._hold(seq, reason)
            elif reason is not None:
                self._finish(seq, reason)

    def accept_drafts(self, seq: Sequence, token_ids: list[int]) -> int:
        """A speculating sequence's verdict, after `postprocess`: `token_ids` are its accepted
        proposals then the target's token. The accepted proposals' KV counts as computed, the
        rejected slots are rewound (their blocks freed); the tokens are appended up to a stop,
        which finishes the sequence. Returns how many were appended."""
        seq.draft_token_ids = []
        num_computed = seq.num_computed_tokens + len(token_ids) - 1
        reason, appended = None, 0
        for token_id in token_ids:
            seq.append_token(token_id)
            appended += 1
            reason = self._stop_reason(seq, token_id)
            if reason is not None:
                break
        seq.num_computed_tokens = min(num_computed, seq.num_tokens)
        self.kv.cache_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens, seq.extra_keys)
        if reason is not None:
            self._finish(seq, reason)
        else:
            self.kv.trim(seq.seq_id, seq.num_tokens)
        return appended

    def _stop_reason(self, seq: Sequence, token_id: int) -> str | None:
        params = seq.params
        if token_id in params.stop_token_ids or (
            not params.ignore_eos and token_id in seq.sampling.eos_token_ids
        ):
            return "stop"
        if len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _hold(self, seq: Sequence, reason: str | None) -> None:
        """Prefill-only: out of the batch after its first token, blocks kept for the reader."""
        self.running.remove(seq)
        seq.status = SequenceStatus.HELD
        seq.finish_reason = reason
        self.held.setdefault(seq.request_id, []).append(seq)

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.PARKED:
            del self.parked[seq.seq_id]
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.kv.free(seq.seq_id)
        if self.proposer is not None:
            self.proposer.forget(seq.seq_id)


def _insert(queue: list[Sequence], seq: Sequence) -> None:
    """Into a list kept by queue_key (after any equal key: FIFO)."""
    bisect.insort_right(queue, seq, key=lambda s: s.queue_key)
