"""Beam search against transformers' `generate(num_beams=...)` on the tiny model: the same
hypotheses, in the same order, whatever the batch, the block pool or the worker split."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.errors import InvalidRequest
from common.sampling_params import BeamSearch, SamplingParams
from engine.beam_search import BeamGroup
from engine.config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from tests.unit.engine.test_disaggregated_engine import run_to_end, tokens_by_choice
from tools.tiny_model.build import TEST_PROMPTS

# (width, length_penalty, early_stopping, max_tokens): each stopping rule, both signs of length
# preference
CASES = [(4, 1.0, False, 16), (3, 0.5, True, 12), (4, 2.0, "never", 10), (2, -1.0, False, 20)]


@pytest.fixture(scope="module")
def hf(tiny_model_path: Path) -> tuple:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="module")
def llm(tiny_model_path: Path) -> LLM:
    return LLM(str(tiny_model_path), num_blocks=512, block_size=4)


@pytest.fixture(scope="module")
def stop_token(llm: LLM) -> int:
    """The tiny model's most frequent greedy output token: as a stop token, it ends many
    hypotheses early (its EOS seldom does), so the done-hypothesis rules are exercised."""
    outs = llm.generate(list(TEST_PROMPTS), SamplingParams(temperature=0.0, max_tokens=16))
    counts = Counter(t for o in outs for t in o.outputs[0].token_ids)
    return counts.most_common(1)[0][0]


def beam_params(width: int, penalty: float, early, max_tokens: int, stop: list[int]):
    return SamplingParams(
        n=width,
        temperature=0.0,
        max_tokens=max_tokens,
        stop_token_ids=stop,
        beam=BeamSearch(width=width, length_penalty=penalty, early_stopping=early),
    )


def hf_beams(hf: tuple, prompt: str, width, penalty, early, max_tokens, stop) -> list[list[int]]:
    """transformers' hypotheses, best first, each cut after its stop token (it pads them)."""
    model, tokenizer = hf
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    eos = [*model.generation_config.eos_token_id, *stop]
    with torch.no_grad():
        out = model.generate(
            ids, do_sample=False, num_beams=width, num_return_sequences=width,
            max_new_tokens=max_tokens, length_penalty=penalty, early_stopping=early,
            eos_token_id=eos,
        )  # fmt: skip
    hypotheses = []
    for row in out[:, ids.shape[1] :].tolist():
        ends = [i for i, t in enumerate(row) if t in eos]
        hypotheses.append(row[: ends[0] + 1] if ends else row)
    return hypotheses


@pytest.mark.parametrize("width, penalty, early, max_tokens", CASES)
def test_beams_match_transformers(hf, llm, stop_token, width, penalty, early, max_tokens) -> None:
    """Three searches in one batch, with a stop token that ends hypotheses early (and, once,
    without: every hypothesis runs to max_tokens)."""
    prompts = list(TEST_PROMPTS[:3])
    for stop in ([stop_token], []) if width == 4 and early is False else ([stop_token],):
        params = beam_params(width, penalty, early, max_tokens, stop)
        outputs = llm.generate(prompts, params)
        for prompt, output in zip(prompts, outputs, strict=True):
            got = [choice.token_ids for choice in output.outputs]
            assert got == hf_beams(hf, prompt, width, penalty, early, max_tokens, stop), prompt
            for choice in output.outputs:
                stopped = choice.token_ids[-1] in {*stop, *llm.engine.eos_token_ids}
                assert choice.finish_reason == ("stop" if stopped else "length")
                assert stopped or len(choice.token_ids) == max_tokens
    assert llm.engine.kv.usage.used == 0


def test_a_tight_block_pool_gives_the_same_beams(tiny_model_path: Path, llm, stop_token) -> None:
    """Blocks for less than the batch's beams: beams are preempted (seen here) and compute
    their tokens again while their siblings wait parked; the hypotheses are the same as with
    room to spare, and no block stays used."""
    tight = LLM(str(tiny_model_path), num_blocks=28, block_size=4, max_num_batched_tokens=16)
    scheduler = tight.engine.scheduler
    preempted = []
    preempt = scheduler._preempt
    scheduler._preempt = lambda seq: (preempted.append(seq.beam is not None), preempt(seq))[1]
    params = beam_params(4, 1.0, False, 16, [])
    prompts = list(TEST_PROMPTS[:3])
    expected = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)]
    assert [[c.token_ids for c in o.outputs] for o in tight.generate(prompts, params)] == expected
    assert preempted and all(preempted)
    assert tight.engine.kv.usage.used == 0 and not scheduler.parked


def test_parked_beams_give_their_blocks_back_when_nothing_else_can_run(
    tiny_model_path: Path, llm
) -> None:
    """One beam parked with its offer, its sibling preempted and no block free for it: nothing
    can run, so the parked beam gives its blocks back and computes its offer again later; the
    hypotheses are those of an engine with room. (While the pool holds only one of the two,
    they take turns: a fallback for pools held by others, who free them in time.)"""
    engine = LLMEngine(EngineConfig(model=str(tiny_model_path), num_blocks=64, block_size=4))
    prompt, params = list(range(10, 23)), beam_params(2, 1.0, False, 8, [])
    engine.add_request("r", prompt, params)
    outputs = engine.step()  # the prompt's step: two beams, running
    scheduler = engine.scheduler
    first, second = scheduler.running
    assert engine.num_running == 2  # what a generation worker counts against its slots
    scheduler._preempt(second)
    engine.kv.allocate_slots("hog", engine.kv.num_free_blocks * 4)  # no block left for it
    outputs += engine.step()  # the first beam offers and parks; the second cannot be admitted
    assert first.status.value == "parked" and second.status.value == "waiting"
    assert engine.num_running == 1  # a parked beam keeps its slot
    # nothing could run: the parked beam went back to the queue, and its blocks let the
    # other in, which offered and parked in turn
    outputs += engine.step()
    assert first.status.value == "waiting" and first.num_computed_tokens == 0
    assert second.status.value == "parked" and list(scheduler.parked.values()) == [second]
    engine.kv.free("hog")
    outputs += run_to_end(engine)
    expected = llm.generate([prompt], params)[0].outputs
    assert tokens_by_choice(outputs) == {c.index: c.token_ids for c in expected}
    assert engine.kv.usage.used == 0


def test_n_returns_the_best_n_of_the_beams(llm) -> None:
    prompt = TEST_PROMPTS[0]
    all_four = llm.generate([prompt], beam_params(4, 1.0, False, 12, []))[0].outputs
    best_two = llm.generate([prompt], SamplingParams(
        n=2, temperature=0.0, max_tokens=12, beam=BeamSearch(width=4)
    ))[0].outputs  # fmt: skip
    assert [c.token_ids for c in best_two] == [c.token_ids for c in all_four[:2]]


def test_beams_start_from_the_context_workers_offer(tiny_model_path: Path, llm) -> None:
    """Disaggregated: the prefill-only engine holds the prompt and offers its first step's best
    continuations (no token); the reader copies the prompt's KV in (what the NIXL READ does),
    starts the beams from that offer, and finds the hypotheses of one engine doing both."""
    config = EngineConfig(model=str(tiny_model_path), num_blocks=256, block_size=4)
    context, generation = LLMEngine(config), LLMEngine(config)
    params = beam_params(3, 1.0, False, 10, [])
    for i, text in enumerate(TEST_PROMPTS[:3]):
        prompt = [int(t) for t in text.encode()[:30]]
        context.add_request(f"r{i}", prompt, params, prefill_only=True)
        [offer] = run_to_end(context)
        assert offer.token_id == -1 and offer.finish_reason is None
        keep = (1 + len(context.eos_token_ids)) * 3  # enough for 3 beams past the stop tokens
        assert offer.beam_candidates is not None and len(offer.beam_candidates) == keep
        source = context.held_block_table(f"r{i}")
        planned = generation.add_pulled_request(
            f"r{i}", prompt, params, {}, beam_candidates=offer.beam_candidates
        )
        assert planned is not None
        table, num_valid = planned
        for src, dst in zip(source[num_valid // 4 :], table[num_valid // 4 :], strict=True):
            generation.kv_cache.pool[dst] = context.kv_cache.pool[src]
        outputs = generation.pull_done(f"r{i}") + run_to_end(generation)
        context.release_held(f"r{i}")
        expected = llm.generate([prompt], params)[0].outputs
        assert tokens_by_choice(outputs) == {c.index: c.token_ids for c in expected}
    for engine in (context, generation):
        assert engine.kv.usage.used == 0 and engine.num_held_blocks == 0


def test_abort_ends_every_choice_and_frees_the_beams(tiny_model_path: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_model_path), num_blocks=128, block_size=4))
    engine.add_request("r", list(range(10, 30)), beam_params(3, 1.0, False, 30, []))
    for _ in range(5):
        engine.step()
    assert engine.kv.usage.used > 0
    aborted = engine.abort("r")
    assert sorted(o.index for o in aborted) == [0, 1, 2]
    assert all(o.finish_reason == "abort" and o.token_id == -1 for o in aborted)
    assert engine.kv.usage.used == 0 and not engine.has_unfinished()


def test_more_stop_tokens_than_a_step_ranks(tiny_model_path: Path) -> None:
    """Each stop token widens what a beam offers (transformers' rule); past the vocabulary the
    offer is the whole vocabulary, not a crash. Here every token but three stops."""
    engine = LLMEngine(EngineConfig(model=str(tiny_model_path), num_blocks=128, block_size=4))
    vocab = engine.model_config.vocab_size
    params = beam_params(2, 1.0, False, 6, [t for t in range(vocab) if t not in (5, 6, 7)])
    engine.add_request("r", list(range(10, 20)), params)
    choices = tokens_by_choice(run_to_end(engine))
    assert sorted(choices) == [0, 1] and engine.kv.usage.used == 0


@pytest.mark.parametrize(
    "field, value",
    [("top_p", 0.9), ("top_k", 5), ("seed", 1), ("logprobs", 2), ("repetition_penalty", 1.1),
     ("logit_bias", {1: 1.0}), ("n", 5)],
)  # fmt: skip
def test_what_beam_search_cannot_honour_is_refused(field: str, value) -> None:
    params = SamplingParams(**{field: value}, beam=BeamSearch(width=4))
    with pytest.raises(InvalidRequest) as refused:
        params.validate(100)
    assert refused.value.param == field


def test_early_stopping_true_stops_once_width_hypotheses_are_done() -> None:
    """The rules alone, on made-up offers: two beams, stop token 9, length_penalty 2. Step one
    ends one hypothesis, step two another; then early_stopping=True stops, while under False
    the search goes on, since the best live beam, scored at its length, beats the worst done."""

    class Beam:  # what BeamGroup reads of a sequence
        def __init__(self, seq_id: str) -> None:
            self.seq_id, self.beam_score, self.output_token_ids = seq_id, 0.0, []

    def group(early) -> BeamGroup:
        beams = [Beam("a"), Beam("b")]
        g = BeamGroup(
            BeamSearch(width=2, length_penalty=2.0, early_stopping=early),
            2,
            10,
            frozenset({9}),
            beams,
        )
        g.offer(beams[0], list(zip([9, 1, 2, 3], [-0.1, -0.2, -0.3, -5.0], strict=True)))
        g.offer(beams[1], list(zip([4, 5, 6, 7], [-4.0, -4.1, -4.2, -4.3], strict=True)))
        chosen = g.select()
        assert [(c.token_id, round(c.score, 6)) for c in chosen] == [(1, -0.2), (2, -0.3)]
        assert [h.token_ids for h in g.done] == [[9]]
        for beam, c in zip(beams, chosen, strict=True):
            beam.beam_score, beam.output_token_ids = c.score, [c.token_id]
        g.offer(beams[0], list(zip([9, 1, 2, 3], [-0.05, -0.1, -0.2, -0.3], strict=True)))
        g.offer(beams[1], list(zip([1, 2, 3, 4], [-0.5, -0.6, -0.7, -0.8], strict=True)))
        return g

    stops = group(True)
    assert stops.select() == [] and stops.finished
    assert [h.token_ids for h in stops.results()] == [[1, 9], [9]]  # -0.25 / 2**2 beats -0.1
    goes_on = group(False)
    assert goes_on.select() and not goes_on.finished
