"""Speculative decoding with a draft model, on the tiny model against the same engine without
speculation: the tiny model drafting for itself (nearly every proposal accepted) and a random
model of the same tokenizer (builtin:tiny-mistral: most rejected). Greedy output and log-probs
equal either way; the draft's KV follows the target's tokens and is freed with each sequence."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from common import guided
from common.config import SpeculativeConfig
from common.sampling_params import SamplingParams
from engine.draft_proposer import DraftModelProposer
from engine.llm import LLM
from tests.unit.engine.test_speculative_engine import PROMPTS, REPEATING, WORDS

BLOCK = 4


def drafting(draft: str) -> SpeculativeConfig:
    return SpeculativeConfig(method="draft_model", model=draft, num_speculative_tokens=4)


@pytest.fixture(scope="module")
def base(tiny_model_path: Path) -> LLM:
    return LLM(str(tiny_model_path), num_blocks=512, block_size=BLOCK)


@pytest.fixture(scope="module")
def self_drafted(tiny_model_path: Path) -> LLM:
    return LLM(str(tiny_model_path), num_blocks=512, block_size=BLOCK,
               speculative=drafting(str(tiny_model_path)))  # fmt: skip


@pytest.fixture(scope="module")
def randomly_drafted(tiny_model_path: Path) -> LLM:
    return LLM(str(tiny_model_path), num_blocks=512, block_size=BLOCK,
               speculative=drafting("builtin:tiny-mistral"))  # fmt: skip


def proposer(llm: LLM) -> DraftModelProposer:
    assert isinstance(llm.engine.scheduler.proposer, DraftModelProposer)
    return llm.engine.scheduler.proposer


def assert_nothing_held(llm: LLM) -> None:
    for kv in (llm.engine.kv, proposer(llm).draft.kv):
        assert kv.usage.used == 0, kv.usage
    assert proposer(llm).shadows == {}


def same_greedy_output(base: LLM, spec: LLM, params: SamplingParams) -> tuple[int, int]:
    """Asserts `spec` gives `base`'s tokens and log-probs on PROMPTS; the tokens it proposed
    and accepted meanwhile."""
    counters = spec.engine.spec
    before = (counters.num_draft_tokens, counters.num_accepted_tokens)
    expected, got = base.generate(PROMPTS, params), spec.generate(PROMPTS, params)
    for e, g in zip(expected, got, strict=True):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
        assert g.outputs[0].logprobs == pytest.approx(e.outputs[0].logprobs, abs=1e-4)
    return counters.num_draft_tokens - before[0], counters.num_accepted_tokens - before[1]


def test_a_model_drafting_for_itself_is_nearly_always_accepted(base: LLM, self_drafted) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=40, logprobs=2, ignore_eos=True)
    proposed, accepted = same_greedy_output(base, self_drafted, params)
    assert proposed > 100 and accepted >= 0.9 * proposed  # the same weights, other kernels
    assert_nothing_held(self_drafted)


def test_rejected_drafts_are_rewound_in_the_draft_too(base: LLM, randomly_drafted) -> None:
    """A random draft is mostly wrong: every step rewinds the shadow's KV past its rejected
    proposals, and the next drafts still come from the target's tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=40, logprobs=2, ignore_eos=True)
    proposed, accepted = same_greedy_output(base, randomly_drafted, params)
    assert proposed > 100 and accepted < 0.5 * proposed
    assert_nothing_held(randomly_drafted)


def test_the_targets_penalties_reject_what_the_raw_draft_proposes(base, self_drafted) -> None:
    """The draft proposes its raw argmax; the target verifies under the request's repetition
    penalty, which the draft never saw: rejections, and the output of plain decoding."""
    params = SamplingParams(temperature=0.0, max_tokens=40, repetition_penalty=1.8)
    counters = self_drafted.engine.spec
    before = (counters.num_draft_tokens, counters.num_accepted_tokens)
    expected = base.generate(REPEATING, params)
    got = self_drafted.generate(REPEATING, params)
    assert [g.outputs[0].token_ids for g in got] == [e.outputs[0].token_ids for e in expected]
    assert counters.num_accepted_tokens - before[1] < counters.num_draft_tokens - before[0]
    assert_nothing_held(self_drafted)


def test_drafts_after_rejections_are_those_of_a_fresh_draft(randomly_drafted: LLM) -> None:
    """Step by step, mostly rejected: the shadow, rewound and caught up each step, proposes what
    a draft that never saw the sequence proposes from its tokens alone."""
    engine = randomly_drafted.engine
    stateful = proposer(randomly_drafted)
    fresh = DraftModelProposer(stateful.draft)  # the same weights and pool, no shadows
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    engine.add_request("r", randomly_drafted.tokenizer.encode(REPEATING[0]), params)
    engine.step()  # the prompt
    compared = 0
    while engine.has_unfinished():
        (seq,) = engine.scheduler.running
        twin = dataclasses.replace(seq, seq_id="twin")
        assert stateful.propose([(seq, 4)]) == fresh.propose([(twin, 4)])
        fresh.forget("twin")
        compared += 1
        engine.step()
    assert compared > 5
    assert_nothing_held(randomly_drafted)


def test_a_shadow_left_behind_while_speculation_paused_catches_up(tiny_model_path) -> None:
    """disable_by_batch_size pauses drafting while a second request runs; the target's tokens
    move on without the draft, whose stale proposals must not be taken for computed KV."""
    spec = SpeculativeConfig(method="draft_model", model="builtin:tiny-mistral",
                             num_speculative_tokens=4, disable_by_batch_size=2)  # fmt: skip
    llm = LLM(str(tiny_model_path), num_blocks=512, block_size=BLOCK, speculative=spec)
    engine, stateful = llm.engine, proposer(llm)
    fresh = DraftModelProposer(stateful.draft)
    engine.add_request("r", llm.tokenizer.encode(REPEATING[0]),
                       SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))  # fmt: skip
    for _ in range(3):
        engine.step()  # the prompt, then two steps with drafts
    engine.add_request("other", llm.tokenizer.encode(REPEATING[1]),
                       SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))  # fmt: skip
    while len(engine.scheduler.running) + len(engine.scheduler.waiting) > 1:
        engine.step()  # a batch of two: no drafts, "r" moves on
    (seq,) = engine.scheduler.running
    twin = dataclasses.replace(seq, seq_id="twin")
    assert stateful.propose([(seq, 4)]) == fresh.propose([(twin, 4)])
    fresh.forget("twin")
    while engine.has_unfinished():
        engine.step()
    assert_nothing_held(llm)


def test_sampled_and_guided_requests_draft_within_their_rules(base, self_drafted) -> None:
    sampled = SamplingParams(temperature=0.8, seed=5, n=3, max_tokens=32, ignore_eos=True)
    first = self_drafted.generate(REPEATING[:2], sampled)
    again = self_drafted.generate(REPEATING[:2], sampled)
    for a, b in zip(first, again, strict=True):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    constrained = SamplingParams(temperature=0.0, max_tokens=80, guided=guided.regex(WORDS))
    expected = base.generate(REPEATING[:2], constrained)
    got = self_drafted.generate(REPEATING[:2], constrained)
    assert [g.outputs[0].token_ids for g in got] == [e.outputs[0].token_ids for e in expected]
    assert_nothing_held(self_drafted)


def test_an_aborted_request_frees_its_drafts_kv(self_drafted: LLM) -> None:
    engine = self_drafted.engine
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    engine.add_request("gone", self_drafted.tokenizer.encode(REPEATING[1]), params)
    for _ in range(4):
        engine.step()
    assert proposer(self_drafted).draft.kv.usage.used > 0
    engine.abort("gone")
    assert_nothing_held(self_drafted)


def test_a_draft_of_another_tokenizer_is_refused_before_it_loads(
    tiny_model_path: Path, smollm2_path: Path
) -> None:
    with pytest.raises(ValueError, match="share the target's tokenizer"):
        LLM(str(tiny_model_path), num_blocks=64, speculative=drafting(str(smollm2_path)))


def test_a_pool_too_small_for_every_shadow_still_decodes_right(tiny_model_path: Path) -> None:
    """Seven sequences in a pool that holds about four: the target preempts and recomputes,
    the draft's shadows fail to get blocks and propose nothing; the output is plain decoding's
    and nothing is held after."""
    tight = {"num_blocks": 48, "block_size": BLOCK}
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected = LLM(str(tiny_model_path), **tight).generate(PROMPTS, params)
    spec = drafting(str(tiny_model_path))
    llm = LLM(str(tiny_model_path), speculative=spec, **tight)
    got = llm.generate(PROMPTS, params)
    assert [g.outputs[0].token_ids for g in got] == [e.outputs[0].token_ids for e in expected]
    assert llm.engine.spec.num_accepted_tokens > 0
    assert_nothing_held(llm)
