"""The speculative verifier against the sampler: greedy verdicts are the sampler's argmax at each
position; rejection sampling keeps the sampler's distribution (a chi-square test on many draws)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from scipy.stats import chisquare

from common.sampling_params import SamplingParams
from engine.sampler import Sampler, SamplingState, adjust_logits, choice_seed, warp_logits
from engine.spec_verify import verify

VOCAB = 6


def _state(output: list[int] | None = None, **params: Any) -> SamplingState:
    sampling = SamplingParams(**params)
    seed = None if sampling.seed is None else choice_seed(sampling.seed)
    return SamplingState(sampling, [0, 1], list(output or []), seed)


def _probs(row: torch.Tensor, state: SamplingState) -> torch.Tensor:
    """The distribution the sampler draws from for this row and state."""
    x = adjust_logits(row[None], [state])
    return torch.softmax(warp_logits(x, [state]), dim=-1)[0]


def test_greedy_accepts_while_the_proposal_is_the_argmax_then_emits_the_argmax() -> None:
    logits = torch.full((4, VOCAB), -1.0)
    for row, best in enumerate([3, 4, 2, 5]):
        logits[row, best] = 1.0
    state = _state(temperature=0.0)
    verified = verify(logits, [state], [[3, 4, 1]])  # the third proposal is wrong
    assert verified.token_ids == [[3, 4, 2]]
    assert verified.num_accepted == [2]
    verified = verify(torch.cat([logits, logits]), [state, state], [[3, 4, 2], [1, 4, 2]])
    assert verified.token_ids == [[3, 4, 2, 5], [3]]  # all accepted: the bonus token
    assert verified.num_accepted == [3, 0]


def test_greedy_applies_each_positions_penalties_and_min_tokens_as_the_sampler_would() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, VOCAB)
    logits[:, 2] = logits.max() + 0.5  # 2 leads everywhere, unless a penalty for it applies
    params = {"temperature": 0.0, "presence_penalty": 2.0, "min_tokens": 2, "stop_token_ids": [5]}
    state = _state(output=[1], **params)
    draft = [2, 2, 0]
    verified = verify(logits, [state], [draft])
    expected = []
    for j in range(len(draft) + 1):  # the plain sampler, one position at a time
        token = Sampler()(logits[j : j + 1], [_state(output=[1, *draft[:j]], **params)]).token_ids
        expected.append(token[0])
        if j == len(draft) or token[0] != draft[j]:
            break
    assert verified.token_ids == [expected]
    assert expected[0] == 2 and expected[1] != 2  # the penalty after the first 2 changed row 1


def test_logprobs_of_emitted_tokens_are_the_raw_models() -> None:
    torch.manual_seed(1)
    logits = torch.randn(3, VOCAB)
    draft = [int(logits[0].argmax()), int(logits[1].argmax())]
    verified = verify(logits, [_state(temperature=0.0, logprobs=2)], [draft])
    tokens = verified.token_ids[0]
    assert tokens == [*draft, int(logits[2].argmax())]
    raw = torch.log_softmax(logits, dim=-1)
    assert verified.logprobs.logprobs == pytest.approx(
        [float(raw[j, t]) for j, t in enumerate(tokens)]
    )
    top = torch.topk(raw, 2, dim=-1)
    reported = verified.logprobs.top_logprobs
    assert reported is not None
    for j in range(3):
        assert [t for t, _ in reported[j]] == top.indices[j].tolist()
        assert [v for _, v in reported[j]] == pytest.approx(top.values[j].tolist())


@pytest.mark.parametrize("proposed", [1, 3, 4])  # likely, unlikely, filtered out by top_k
def test_rejection_sampling_keeps_the_samplers_distribution(proposed: int) -> None:
    """Each emitted token, the first and (after an accepted proposal) the next, is distributed as
    the sampler's own: chi-square over 6000 draws with a fixed seed."""
    torch.manual_seed(1234)
    row0 = torch.tensor([0.5, 2.0, 1.0, 0.2, -3.0, 0.8])
    row1 = torch.tensor([1.0, 1.5, 0.1, 1.2, 0.3, -0.5])
    params = {"temperature": 0.8, "top_k": 4, "presence_penalty": 0.7}
    state = _state(output=[5], **params)
    num_draws = 6000
    logits = torch.stack([row0, row1]).repeat(num_draws, 1)  # (2 * num_draws, vocab)
    verified = verify(logits, [state] * num_draws, [[proposed]] * num_draws)
    p0 = _probs(row0, state)
    p1 = _probs(row1, _state(output=[5, proposed], **params))  # the proposal is seen by then
    first = Counter(tokens[0] for tokens in verified.token_ids)
    assert first[proposed] == sum(verified.num_accepted)
    _assert_distributed_as(first, p0, num_draws)
    after = Counter(tokens[1] for tokens in verified.token_ids if len(tokens) == 2)
    if p0[proposed] > 0:
        _assert_distributed_as(after, p1, sum(after.values()))
    else:
        assert not after  # a proposal the filters rule out is never accepted


def _assert_distributed_as(counts: Counter[int], probs: torch.Tensor, num: int) -> None:
    support = [t for t in range(VOCAB) if probs[t] > 0]
    assert set(counts) <= set(support)  # nothing outside the filters' support
    observed = [counts[t] for t in support]
    expected = [float(probs[t]) * num for t in support]
    scale = sum(observed) / sum(expected)
    assert chisquare(observed, [e * scale for e in expected]).pvalue > 1e-3
    total_variation = 0.5 * sum(
        abs(o / num - float(probs[t])) for o, t in zip(observed, support, strict=True)
    )
    assert total_variation < 0.03


def test_seeded_verdicts_repeat_themselves() -> None:
    torch.manual_seed(5)
    logits = torch.randn(4, VOCAB)
    state = _state(temperature=1.0, seed=42)
    runs = [verify(logits, [state], [[1, 2, 3]]).token_ids for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]
