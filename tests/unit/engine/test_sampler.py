"""The sampler against torch and Hugging Face references: filters, penalties, logprobs, seeds."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import pytest
import torch
from transformers import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from common.sampling_params import SamplingParams
from engine.sampler import (
    Sampler,
    SamplingState,
    _choose,
    _plain_greedy_choice,
    adjust_logits,
    choice_seed,
    row_argmax,
    warp_logits,
)

VOCAB = 64


def _state(
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    eos: frozenset[int] = frozenset(),
    index: int = 0,
    **params: Any,
) -> SamplingState:
    sampling = SamplingParams(**params)
    seed = None if sampling.seed is None else choice_seed(sampling.seed, index)
    return SamplingState(sampling, list(prompt or []), list(output or []), seed, eos)


def _logits(num_rows: int, vocab: int = VOCAB, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, vocab, generator=generator) * scale  # (num_rows, vocab)


def _hf_warp(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """HF's warper chain in generate()'s order, on one (1, vocab) row."""
    scores = row.clone()
    ids = torch.LongTensor([[0]])  # the warpers ignore it
    if params.temperature != 1.0:
        scores = TemperatureLogitsWarper(params.temperature)(ids, scores)
    if params.top_k > 0:
        scores = TopKLogitsWarper(params.top_k)(ids, scores)
    if params.top_p < 1.0:
        scores = TopPLogitsWarper(params.top_p)(ids, scores)
    if params.min_p > 0.0:
        scores = MinPLogitsWarper(params.min_p)(ids, scores)
    return scores


def test_greedy_rows_take_argmax_with_ties_to_the_lowest_id() -> None:
    logits = _logits(5)
    logits[2, [7, 11, 30]] = 100.0  # a three-way tie
    result = Sampler()(logits, [_state(temperature=0.0) for _ in range(5)])
    assert result.token_ids == logits.argmax(dim=-1).tolist()
    assert result.token_ids[2] == 7
    assert result.logprobs is None and result.top_logprobs is None


def test_greedy_rows_in_a_mixed_batch_still_take_argmax() -> None:
    logits = _logits(4)
    states = [_state(temperature=0.0), _state(seed=1), _state(temperature=0.0), _state()]
    result = Sampler()(logits, states)
    assert result.token_ids[0] == logits[0].argmax().item()
    assert result.token_ids[2] == logits[2].argmax().item()


def test_logprobs_come_from_the_raw_logits() -> None:
    logits = _logits(3)
    states = [
        _state(logprobs=0, temperature=0.3, repetition_penalty=1.5, prompt=[1, 2, 3], seed=0),
        _state(logprobs=3, logit_bias={5: 50.0}, presence_penalty=1.0, output=[4]),
        _state(),  # asks for nothing
    ]
    result = Sampler()(logits, states)
    reference = torch.log_softmax(logits.double(), dim=-1)  # (3, vocab)
    assert result.logprobs is not None and result.top_logprobs is not None
    for row, token_id in enumerate(result.token_ids):
        assert result.logprobs[row] == pytest.approx(reference[row, token_id].item(), abs=1e-5)
    assert result.token_ids[1] == 5  # the bias chose the token, the logprob is still the raw one
    assert result.top_logprobs[0] == [] and result.top_logprobs[2] == []


def test_top_logprobs_are_the_k_best_raw_tokens_in_order() -> None:
    logits = _logits(2)
    states = [_state(logprobs=5, temperature=0.0), _state(logprobs=2)]
    result = Sampler()(logits, states)
    reference = torch.log_softmax(logits.double(), dim=-1)  # (2, vocab)
    assert result.top_logprobs is not None
    for row, k in enumerate((5, 2)):
        top = result.top_logprobs[row]
        assert len(top) == k
        values = [value for _, value in top]
        assert values == sorted(values, reverse=True)
        expected = torch.topk(reference[row], k)
        assert [token_id for token_id, _ in top] == expected.indices.tolist()
        assert values == pytest.approx(expected.values.tolist(), abs=1e-5)


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 0.7},
        {"top_k": 5},
        {"top_p": 0.6},
        {"min_p": 0.1},
        {"temperature": 1.3, "top_k": 20, "top_p": 0.8, "min_p": 0.05},
    ],
)
def test_each_filter_matches_the_hf_warper(params: dict[str, Any]) -> None:
    logits = _logits(3)
    # Rows with other settings ride along: per-row parameters are checked, not one batch-wide value.
    states = [_state(**params), _state(top_k=2, top_p=0.3), _state()]
    warped = warp_logits(logits.clone(), states)  # (3, vocab)
    for row, state in enumerate(states):
        expected = _hf_warp(logits[row : row + 1], state.params)[0]
        kept = torch.isfinite(warped[row])
        assert torch.equal(kept, torch.isfinite(expected)), state.params
        torch.testing.assert_close(warped[row][kept], expected[kept])


def test_top_p_keeps_the_smallest_set_reaching_the_mass_exactly() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, 0.0]]) * math.log(2.0)  # probs 1/2, 1/4, 1/8, 1/8: exact
    state = _state(top_p=0.75)
    warped = warp_logits(logits.clone(), [state])
    expected = _hf_warp(logits, state.params)
    assert torch.isfinite(warped).tolist() == [[True, True, False, False]]
    assert torch.equal(torch.isfinite(warped), torch.isfinite(expected))


def test_top_k_beyond_vocab_or_disabled_keeps_everything() -> None:
    logits = _logits(3)
    states = [_state(top_k=0), _state(top_k=-1), _state(top_k=VOCAB + 10)]
    assert torch.equal(warp_logits(logits.clone(), states), logits)


def test_repetition_penalty_matches_hf_over_prompt_and_output() -> None:
    logits = _logits(3)
    states = [
        _state(repetition_penalty=1.3, prompt=[1, 2, 2, 9], output=[3, 40]),
        _state(repetition_penalty=0.7, prompt=[5], output=[6, 6]),
        _state(prompt=[1, 2, 3]),  # penalty 1.0: untouched
    ]
    adjusted = adjust_logits(logits, states)
    for row, state in enumerate(states):
        ids = torch.tensor([state.prompt_token_ids + state.output_token_ids])
        processor = RepetitionPenaltyLogitsProcessor(state.params.repetition_penalty)
        expected = processor(ids, logits[row : row + 1].clone())[0]
        torch.testing.assert_close(adjusted[row], expected)


def test_presence_and_frequency_penalties_follow_openai() -> None:
    logits = _logits(2)
    output = [3, 3, 3, 7, 12, 12]
    states = [
        _state(presence_penalty=0.5, frequency_penalty=0.25, prompt=[7, 8], output=output),
        _state(presence_penalty=-1.0, output=[1]),
    ]
    adjusted = adjust_logits(logits, states)
    for row, state in enumerate(states):
        expected = logits[row].clone()
        for token_id, count in Counter(state.output_token_ids).items():  # the prompt does not count
            expected[token_id] -= state.params.presence_penalty
            expected[token_id] -= state.params.frequency_penalty * count
        torch.testing.assert_close(adjusted[row], expected)


def test_logit_bias_forces_and_forbids_tokens() -> None:
    logits = _logits(3, scale=1.0)
    winner = int(logits[0].argmax())
    states = [
        _state(temperature=0.0, logit_bias={winner: -100.0}),
        _state(temperature=0.0, logit_bias={17: 100.0}),
        _state(seed=3, logit_bias={42: 100.0}),
    ]
    for _ in range(5):
        token_ids = Sampler()(logits, states).token_ids
        assert token_ids[0] != winner
        assert token_ids[1:] == [17, 42]


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.zeros(4, VOCAB)
    logits[:, 2] = 10.0  # EOS is the favourite
    logits[:, 9] = 9.0  # then a stop token
    logits[:, 20] = 8.0
    eos = frozenset({2})
    states = [
        _state(temperature=0.0, min_tokens=3, stop_token_ids=[9], output=[5], eos=eos),
        _state(temperature=0.0, min_tokens=3, stop_token_ids=[9], output=[5, 5, 5], eos=eos),
        _state(temperature=0.0, min_tokens=3, ignore_eos=True, stop_token_ids=[9], eos=eos),
        _state(temperature=0.0, stop_token_ids=[9], eos=eos),
    ]
    assert Sampler()(logits, states).token_ids == [20, 2, 2, 2]


def test_seeded_row_is_the_same_alone_and_in_a_mixed_batch() -> None:
    vocab = 1000
    params: dict[str, Any] = {"seed": 1234, "temperature": 0.9, "top_k": 200, "top_p": 0.95}
    alone = _state(**params)
    batched = _state(**params)
    others = [
        _state(temperature=0.0),
        _state(),
        _state(seed=99, min_p=0.2),
        _state(top_p=0.5, presence_penalty=1.0, output=[1, 2]),
    ]
    sampler = Sampler()
    alone_tokens, batched_tokens = [], []
    for step in range(8):
        logits = _logits(5, vocab=vocab, seed=step, scale=0.5)  # flat: many plausible tokens
        alone_tokens += sampler(logits[2:3], [alone]).token_ids
        alone.append(alone_tokens[-1])
        torch.manual_seed(step)  # moves the shared stream, which seeded rows must not depend on
        batch = others[:2] + [batched] + others[2:]
        batched_tokens.append(sampler(logits, batch).token_ids[2])
        batched.append(batched_tokens[-1])
    assert alone_tokens == batched_tokens


def test_different_seeds_and_choice_indices_give_different_tokens() -> None:
    logits = torch.zeros(1, 1000)  # uniform
    sampler = Sampler()

    def run(seed: int, index: int, output: list[int] | None = None) -> list[int]:
        state = _state(seed=seed, index=index, output=output)
        for _ in range(10):
            state.append(sampler(logits, [state]).token_ids[0])
        return state.output_token_ids

    assert run(1, 0) == run(1, 0)
    assert run(1, 0) != run(2, 0)
    assert run(1, 0) != run(1, 1)
    assert len(set(run(1, 0))) > 5  # each position draws afresh
    # A draw depends on the position, not on how the state got there: resuming after the first
    # token (what a generation worker does after the context worker's) continues the same way.
    whole = run(1, 0)
    assert run(1, 0, output=whole[:1])[:10] == whole


def test_choice_seed_accepts_any_int_seed() -> None:
    seeds = {choice_seed(seed, index=3) for seed in (-1, 0, 2**63, 2**64 - 1, 2**70)}
    assert all(0 <= s < 2**64 for s in seeds) and len(seeds) == 3  # taken modulo 2**64


@pytest.mark.parametrize("params", [{}, {"temperature": 0.6, "top_k": 5}])
def test_samples_follow_the_warped_softmax(params: dict[str, Any]) -> None:
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0]])
    num_draws = 20_000
    state = _state(**params)
    torch.manual_seed(0)
    token_ids = Sampler()(logits.expand(num_draws, -1), [state] * num_draws).token_ids
    expected = torch.softmax(_hf_warp(logits, state.params)[0], dim=-1) * num_draws
    observed = torch.bincount(torch.tensor(token_ids), minlength=logits.shape[1]).float()
    assert observed[expected == 0].sum() == 0
    support = expected > 0
    chi_square = ((observed - expected)[support] ** 2 / expected[support]).sum().item()
    assert chi_square < 30.0  # 7 degrees of freedom: p < 1e-4


def test_degenerate_rows_never_produce_nan() -> None:
    vocab = 4
    logits = torch.tensor(
        [
            [0.0, 3.0, 1.0, 2.0],  # min_tokens masks every id
            [float("-inf")] * vocab,
            [float("nan"), 1.0, 2.0, float("nan")],
            [0.0, float("inf"), 1.0, 2.0],
            [0.0, 1.0, 5.0, 2.0],  # temperature far below float32 range
        ]
    )
    masked: dict[str, Any] = {"min_tokens": 2, "stop_token_ids": [2, 3], "eos": frozenset({0, 1})}
    sampler = Sampler()
    for temperature in (0.0, 1.0):
        states = [_state(temperature=temperature, logprobs=2, **masked)]
        states += [_state(temperature=temperature, logprobs=2, top_p=0.01) for _ in range(3)]
        states.append(_state(temperature=1e-30 if temperature else 0.0, logprobs=2))
        result = sampler(logits, states)
        assert result.token_ids == [1, 0, 2, 1, 2]  # the masked row keeps its raw argmax
        assert result.logprobs is not None
        assert not any(math.isnan(value) for value in result.logprobs)


def test_row_argmax_is_torchs_ties_and_nans_included() -> None:
    """row_argmax (numpy's on a CPU float32 matrix) picks what torch.argmax picks: the first of
    tied maxima, the first NaN, the first of an all -inf row, an +inf over any finite value;
    other dtypes and shapes go to torch itself."""
    x = torch.randn(6, 49152, generator=torch.Generator().manual_seed(3))
    x[1, [7, 300]] = float("nan")
    x[2] = 5.0
    x[3] = float("-inf")
    x[4, 9000] = float("inf")
    x[5, [40, 41]] = 1e9
    assert torch.equal(row_argmax(x), x.argmax(dim=-1))
    assert row_argmax(x).tolist()[1:] == [7, 0, 0, 9000, 40]
    with torch.inference_mode():
        y = x[:, ::2].clone()
    assert torch.equal(row_argmax(y), y.argmax(dim=-1))
    assert torch.equal(row_argmax(x.bfloat16()), x.bfloat16().argmax(dim=-1))


def test_plain_greedy_rows_pick_what_the_stages_pick() -> None:
    """All-greedy rows that no stage touches skip the stages' copy: the same tokens as the
    stages' path, also where a row holds NaN, +inf or only -inf (those go through the stages);
    a row with a stage (a bias) sends the batch through them."""
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(5, VOCAB, generator=g)
    logits[1, 3] = float("nan")
    logits[2, [5, 9]] = float("inf")
    logits[3] = float("-inf")
    logits[4, [10, 20]] = 7.0
    states = [_state(temperature=0.0) for _ in range(5)]
    stages = _choose(adjust_logits(logits, states), states).tolist()
    assert Sampler()(logits, states).token_ids == stages
    assert stages[1:] == [int(logits[1].nan_to_num(nan=-math.inf).argmax()), 5, 0, 10]
    assert _plain_greedy_choice(logits[[0, 4]], [states[0], states[4]]).tolist() == [
        stages[0],
        10,
    ]
    assert _plain_greedy_choice(logits[[1]], [states[1]]) is None  # its NaN: the stages decide
    biased = [_state(temperature=0.0, logit_bias={7: 100.0})] + states[1:]
    assert _plain_greedy_choice(logits, biased) is None
    assert Sampler()(logits, biased).token_ids[0] == 7
