"""Speculative proposals from a draft model: a smaller model of the same tokenizer, run greedily
beside the target on the engine that decodes (`speculative: {method: draft_model, model: ...}`).

The draft is an engine of its own (weights, KV pool, runner: its C and Triton paths are the
target's); each target sequence has a shadow sequence there, whose KV follows the target's
tokens. One step proposes for every decoding sequence at once:

    catch up    the shadow's KV up to the target's last token: the tokens the target added since
                (its accepted proposals and its own token; the whole prompt the first time, as a
                prefill), rewound first past any proposal the target rejected
    draft       d1 from that forward's last row, then k - 1 one-token decode forwards: d2 .. dk,
                every shadow in one batch

    target   ... t  a1 c            (last step: d1 = a1 accepted, d2 rejected, c the target's)
    shadow   ... t  a1 d2 d3        KV computed through d3 (d4 was never run)
    rewind   ... t  a1              the common prefix; then c is computed and drafting resumes

The proposals are the draft's argmax: a deterministic proposal, which the verifier's rejection
sampling (engine/spec_verify.py) keeps exact for sampled requests too. A shadow's blocks are
freed when its sequence finishes; a shadow that cannot get blocks proposes nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from common.sampling_params import SamplingParams
from engine.sampler import SamplingState, row_argmax
from engine.scheduler import ScheduledChunk, SchedulerOutput
from engine.sequence import Sequence

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine


class DraftModelProposer:
    """`draft`: the draft model's engine (only its model, KV pool and runner are used), of the
    target's tokenizer (LLMEngine checks its vocabulary is within the target's)."""

    def __init__(self, draft: LLMEngine) -> None:
        self.draft = draft
        self.shadows: dict[str, Sequence] = {}  # target seq id -> its shadow

    def forget(self, seq_id: str) -> None:
        if self.shadows.pop(seq_id, None) is not None:
            self.draft.kv.free(seq_id)

    def propose(self, wanted: list[tuple[Sequence, int]]) -> list[list[int]]:
        ready = {}  # target seq id -> (shadow, k): those with KV blocks for their drafting
        for seq, k in wanted:
            k = min(k, self.draft.max_model_len - seq.num_tokens)
            shadow = self._follow(seq)
            if k > 0 and self.draft.kv.allocate_slots(seq.seq_id, seq.num_tokens + k - 1):
                ready[seq.seq_id] = (shadow, k)
        if ready:
            self._draft(list(ready.values()))
        return [
            ready[seq.seq_id][0].token_ids[seq.num_tokens :] if seq.seq_id in ready else []
            for seq, _ in wanted
        ]

    def _follow(self, seq: Sequence) -> Sequence:
        """The shadow of `seq`, its tokens now the target's and its KV rewound to the longest
        computed prefix they share (at most all but the last token, whose row drafts d1)."""
        shadow = self.shadows.get(seq.seq_id)
        if shadow is None:
            params = SamplingParams(max_tokens=1)  # unused: the runner reads none of it
            shadow = Sequence(seq.seq_id, seq.request_id, 0, [], 0, SamplingState(params, []))
            self.shadows[seq.seq_id] = shadow
        computed = shadow.token_ids[: shadow.num_computed_tokens]
        common = next(
            (i for i, (a, b) in enumerate(zip(computed, seq.token_ids, strict=False)) if a != b),
            min(len(computed), seq.num_tokens),
        )
        shadow.num_computed_tokens = min(common, seq.num_tokens - 1)
        if shadow.num_computed_tokens < len(computed):
            self.draft.kv.trim(seq.seq_id, shadow.num_computed_tokens)
        shadow.token_ids = list(seq.token_ids)
        shadow.num_prompt_tokens = seq.num_prompt_tokens  # what LongRoPE picks its table by
        return shadow

    def _draft(self, shadows: list[tuple[Sequence, int]]) -> None:
        """k forwards at most: each appends one greedy token to the shadows still drafting."""
        for j in range(max(k for _, k in shadows)):
            drafting = [shadow for shadow, k in shadows if k > j]
            out = SchedulerOutput(
                [ScheduledChunk(s, s.num_tokens - s.num_computed_tokens) for s in drafting]
            )
            seqs, logits, _, _ = self.draft.runner.run(out)
            tokens = row_argmax(logits).tolist()  # (rows,): one row a shadow
            for shadow, token_id in zip(seqs, tokens, strict=True):
                shadow.num_computed_tokens = shadow.num_tokens
                shadow.token_ids.append(token_id)
