"""Speculative decoding in the engine on the tiny model, against the same engine without it:
greedy output and log-probs equal, stops inside an accepted run, the KV of rejected proposals
rewound and freed, the prefix cache holding accepted tokens only."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from common import guided
from common.block_hash import block_hashes
from common.config import SpeculativeConfig
from common.errors import InvalidRequest
from common.sampling_params import BeamSearch, SamplingParams
from engine.llm import LLM
from engine.sequence import SequenceStatus
from tools.tiny_model.build import TEST_PROMPTS

BLOCK = 4
SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)
# the tiny model soon repeats itself: proposals get accepted (and some rejected)
REPEATING = [
    "one two three four five one two three four five one two three four five one two",
    "def f(x):\n    return x + 1\n\ndef f(x):\n    return x + 1\n\ndef f(x):\n",
    [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7],
]
PROMPTS = [*REPEATING, *TEST_PROMPTS[:4]]


@pytest.fixture(scope="module")
def base(tiny_model_path: Path) -> LLM:
    return LLM(str(tiny_model_path), num_blocks=512, block_size=BLOCK)


@pytest.fixture(scope="module")
def spec(tiny_model_path: Path) -> LLM:
    return LLM(str(tiny_model_path), num_blocks=512, block_size=BLOCK, speculative=SPEC)


def assert_no_blocks_in_use(llm: LLM) -> None:
    usage = llm.engine.kv.usage
    assert usage.used == 0, usage
    assert usage.free + usage.cached == usage.total, usage


def test_greedy_output_and_logprobs_equal_without_speculation(base: LLM, spec: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=40, logprobs=3, ignore_eos=True)
    before = spec.engine.spec.num_accepted_tokens
    expected, got = base.generate(PROMPTS, params), spec.generate(PROMPTS, params)
    for e, g in zip(expected, got, strict=True):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
        assert g.outputs[0].logprobs == pytest.approx(e.outputs[0].logprobs, abs=1e-4)
        assert [[t for t, _ in top] for top in g.outputs[0].top_logprobs] == [
            [t for t, _ in top] for top in e.outputs[0].top_logprobs
        ]
        assert g.outputs[0].finish_reason == e.outputs[0].finish_reason == "length"
    counters = spec.engine.spec
    assert counters.num_accepted_tokens - before > 40  # several tokens a step, often
    assert counters.num_accepted_tokens < counters.num_draft_tokens  # and some rejections
    assert spec.engine.num_generated_tokens == base.engine.num_generated_tokens
    assert_no_blocks_in_use(spec)


def test_a_stop_token_or_max_tokens_inside_an_accepted_run_ends_it_there(
    base: LLM, spec: LLM
) -> None:
    prompt = REPEATING[2]
    full = base.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30))[0]
    tokens = full.outputs[0].token_ids
    stop = tokens[9]  # well inside the repeating run
    end = tokens.index(stop) + 1
    for params, expected, reason in [
        (
            SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop]),
            tokens[:end],
            "stop",
        ),
        (SamplingParams(temperature=0.0, max_tokens=7), tokens[:7], "length"),
    ]:
        out = spec.generate([prompt], params)[0].outputs[0]
        assert (out.token_ids, out.finish_reason) == (expected, reason)
    assert_no_blocks_in_use(spec)


def test_rejected_proposals_are_rewound_and_their_blocks_freed(spec: LLM) -> None:
    """After every step: a running sequence holds blocks for its tokens only, and the blocks the
    prefix cache knows hold its accepted tokens (hashes of its own token ids)."""
    engine = spec.engine
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS[:4]):
        ids = spec.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        engine.add_request(f"kv-{i}", ids, params)
    rejected_before = engine.spec.num_draft_tokens - engine.spec.num_accepted_tokens
    try:
        _check_every_step(spec)
    finally:
        for i in range(4):
            engine.abort(f"kv-{i}")
    assert engine.spec.num_draft_tokens - engine.spec.num_accepted_tokens > rejected_before
    assert_no_blocks_in_use(spec)


def _check_every_step(spec: LLM) -> None:
    engine = spec.engine
    while engine.has_unfinished():
        engine.step()
        for seq in engine.scheduler.running:
            assert seq.status is SequenceStatus.RUNNING and not seq.draft_token_ids
            assert seq.num_computed_tokens == seq.num_tokens - 1
            table = engine.kv._seqs[seq.seq_id]
            assert len(table.block_ids) <= -(-seq.num_tokens // BLOCK)  # none past its tokens
            assert len(table.block_hashes) * BLOCK <= seq.num_computed_tokens
            hashes = block_hashes(seq.token_ids[: len(table.block_hashes) * BLOCK], BLOCK)
            assert table.block_hashes == hashes


def test_seeded_sampling_repeats_and_n_choices_each_speculate(spec: LLM) -> None:
    params = SamplingParams(temperature=0.7, seed=11, n=3, max_tokens=32, ignore_eos=True)
    before = spec.engine.spec.num_accepted_tokens
    first = spec.generate(REPEATING[:2], params)
    assert spec.engine.spec.num_accepted_tokens > before
    again = spec.generate(REPEATING[:2], params)
    for a, b in zip(first, again, strict=True):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
        assert all(len(o.token_ids) == 32 for o in a.outputs)
    assert_no_blocks_in_use(spec)


def test_beam_search_is_refused_with_speculation_on(spec: LLM) -> None:
    beam = SamplingParams(temperature=0.0, max_tokens=12, n=2, beam=BeamSearch(width=3))
    with pytest.raises(InvalidRequest, match="beam search") as refused:
        spec.generate(REPEATING[:1], beam)
    assert refused.value.param == "use_beam_search"
    assert_no_blocks_in_use(spec)


WORDS = r"(one|two|three|four|five)( (one|two|three|four|five)){24}"


def test_guided_sequences_speculate_within_the_grammar(base: LLM, spec: LLM) -> None:
    """Proposals are cut where the grammar forbids, and each verified position is masked by
    the grammar's state after the proposals before it: greedy output as without speculation."""
    constrained = SamplingParams(temperature=0.0, max_tokens=80, guided=guided.regex(WORDS))
    before = spec.engine.spec.num_accepted_tokens
    expected = base.generate(REPEATING[:2], constrained)
    got = spec.generate(REPEATING[:2], constrained)
    for e, g in zip(expected, got, strict=True):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
        assert re.fullmatch(WORDS, g.outputs[0].text), g.outputs[0].text
    assert spec.engine.spec.num_accepted_tokens - before > 10
    assert_no_blocks_in_use(spec)


def test_sampled_guided_output_keeps_to_the_grammar(spec: LLM) -> None:
    """Rejection sampling draws the correction from the masked distribution: whatever is
    accepted or drawn, the text is in the grammar's language."""
    params = SamplingParams(temperature=1.0, seed=3, n=4, max_tokens=80, guided=guided.regex(WORDS))
    before = spec.engine.spec.num_drafts
    for output in spec.generate(REPEATING[:1], params)[0].outputs:
        assert re.fullmatch(WORDS, output.text), output.text
    assert spec.engine.spec.num_drafts > before
    assert_no_blocks_in_use(spec)
