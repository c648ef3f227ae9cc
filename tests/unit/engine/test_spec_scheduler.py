"""The scheduler with speculation, exact ids: a decoding sequence's chunk carries its proposals,
a verdict rewinds the rejected ones and frees their blocks, and speculation never preempts."""

from __future__ import annotations

from common.config import SpeculativeConfig
from common.sampling_params import SamplingParams
from engine.kv_cache_manager import KVCacheManager
from engine.sampler import SampleResult, SamplingState
from engine.scheduler import Scheduler
from engine.sequence import Sequence

BLOCK = 4
SPEC = SpeculativeConfig(num_speculative_tokens=5, prompt_lookup_min=1, prompt_lookup_max=2)
PROMPT = [1, 2, 3, 4, 5, 6, 7, 1, 2]  # ends in "1 2": proposes 3 4 5 6 7


def decoding(num_blocks: int, max_tokens: int = 100) -> tuple[Scheduler, Sequence]:
    """A sequence whose prompt ran and sampled nothing yet: its last prompt token to decode."""
    sched = Scheduler(KVCacheManager(num_blocks, BLOCK), 8, 64, max_model_len=256, speculative=SPEC)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    seq = Sequence("s", "s", 0, list(PROMPT), len(PROMPT), SamplingState(params, list(PROMPT)))
    sched.add(seq)
    out = sched.schedule()
    out.chunks[0].num_new_tokens -= 1  # leave the last prompt token for the decode step
    sched.postprocess(out, [], SampleResult([], None, None))
    assert seq.num_computed_tokens == len(PROMPT) - 1
    return sched, seq


def test_a_decode_chunk_carries_the_proposals_and_a_verdict_rewinds_the_rejected() -> None:
    sched, seq = decoding(num_blocks=8)
    out = sched.schedule()
    assert [(c.seq, c.num_new_tokens) for c in out.chunks] == [(seq, 6)]
    assert seq.draft_token_ids == [3, 4, 5, 6, 7] and out.chunks[0].samples
    assert len(sched.kv.block_table("s")) == 4  # 8 computed + 6 new = 14 tokens
    sched.postprocess(out, [], SampleResult([], None, None))
    assert sched.accept_drafts(seq, [3, 4, 9]) == 3  # 3 and 4 accepted, 9 the target's
    assert seq.token_ids == [*PROMPT, 3, 4, 9] and not seq.draft_token_ids
    assert seq.num_computed_tokens == 11  # the prompt and 3, 4; 9 is decoded next
    assert len(sched.kv.block_table("s")) == 3  # block 4 held rejected slots only: freed
    assert sched.kv.usage.used == 3 and sched.kv.usage.free + sched.kv.usage.cached == 5


def test_a_stop_inside_the_accepted_run_finishes_there_and_frees_everything() -> None:
    sched, seq = decoding(num_blocks=8, max_tokens=2)
    out = sched.schedule()
    assert seq.draft_token_ids == [3]  # max_tokens leaves room for one proposal
    sched.postprocess(out, [], SampleResult([], None, None))
    assert sched.accept_drafts(seq, [3, 4]) == 2
    assert seq.finish_reason == "length" and sched.kv.usage.used == 0


def test_speculation_never_preempts() -> None:
    # 3 blocks: the 9 prompt tokens and 1 more fit, the proposals' 5 more do not
    sched, seq = decoding(num_blocks=3)
    out = sched.schedule()
    assert [(c.seq, c.num_new_tokens) for c in out.chunks] == [(seq, 1)]
    assert not seq.draft_token_ids and not out.preempted


def test_no_proposals_in_a_batch_of_disable_by_batch_size() -> None:
    sched, seq = decoding(num_blocks=16)
    sched.speculative = SpeculativeConfig(num_speculative_tokens=5, disable_by_batch_size=1)
    out = sched.schedule()
    assert [(c.seq, c.num_new_tokens) for c in out.chunks] == [(seq, 1)]
    sched.speculative = SpeculativeConfig(num_speculative_tokens=5, disable_by_batch_size=2)
    sched.postprocess(out, [seq], SampleResult([1], None, None))  # "... 1 2 1": proposes 2 3 ...
    out = sched.schedule()
    assert [(c.seq, c.num_new_tokens) for c in out.chunks] == [(seq, 6)]


def test_a_prompt_chunked_to_one_token_a_step_gets_no_proposals() -> None:
    sched = Scheduler(KVCacheManager(16, BLOCK), 8, 1, max_model_len=256, speculative=SPEC)
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    seq = Sequence("s", "s", 0, list(PROMPT), len(PROMPT), SamplingState(params, list(PROMPT)))
    sched.add(seq)
    for _ in range(len(PROMPT) - 1):  # a budget of one token: the prompt one token a step
        out = sched.schedule()
        assert [(c.seq, c.num_new_tokens) for c in out.chunks] == [(seq, 1)]
        assert not seq.draft_token_ids and not out.chunks[0].samples
        sched.postprocess(out, [], SampleResult([], None, None))
