"""engine/thinking_budget.py alone, and through the tiny model's engine: the budget's forced end."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.errors import InvalidRequest
from common.guided import regex
from common.sampling_params import SamplingParams, ThinkingBudget
from engine.llm import LLM
from engine.thinking_budget import ThinkingTracker

START, END, A, B = [7], [8, 9], 1, 2  # a two-token end marker


def feed(tracker: ThinkingTracker, tokens: list[int]) -> list[int | None]:
    """The forced token before each token is appended."""
    forced = []
    for token in tokens:
        forced.append(tracker.forced_token())
        tracker.append(token)
    return forced


def test_the_end_marker_is_forced_once_the_budget_is_spent() -> None:
    tracker = ThinkingTracker(ThinkingBudget(tokens=2, start=START, end=END))
    forced = feed(tracker, [A, 7, A, B, 8, 9, B])
    assert forced == [None, None, None, None, 8, 9, None]
    assert not tracker.inside and tracker.spent == 2


def test_the_model_ending_early_spends_less_and_a_new_block_shares_the_budget() -> None:
    tracker = ThinkingTracker(ThinkingBudget(tokens=3, start=START, end=END, open_at_start=True))
    assert feed(tracker, [A, 8, 9, B, 7, A, B]) == [None] * 7  # 1 spent, then 2 more
    assert tracker.forced_token() == 8 and tracker.spent == 3


def test_a_zero_budget_with_thinking_open_forces_the_end_at_once() -> None:
    tracker = ThinkingTracker(ThinkingBudget(tokens=0, start=START, end=END, open_at_start=True))
    assert feed(tracker, [8, 9, A]) == [8, 9, None]


def test_a_budget_with_a_grammar_is_refused() -> None:
    params = SamplingParams(
        thinking_budget=ThinkingBudget(tokens=2, start=START, end=END), guided=regex("[a-z]+")
    )
    with pytest.raises(InvalidRequest) as refused:
        params.validate()
    assert refused.value.param == "thinking_token_budget"


def test_the_engine_forces_the_end_of_thinking_in_the_output(tiny_model_path: Path) -> None:
    llm = LLM(str(tiny_model_path))
    think, end = (llm.tokenizer.convert_tokens_to_ids(t) for t in ("<think>", "</think>"))
    # The bias makes <think> the argmax at every step: only the budget can end thinking.
    budget = ThinkingBudget(tokens=3, start=[think], end=[end])
    biased = {"temperature": 0.0, "max_tokens": 8, "logit_bias": {think: 100.0}, "ignore_eos": True}
    free = llm.generate(["hello"], SamplingParams(**biased))[0].outputs[0].token_ids
    capped = llm.generate(["hello"], SamplingParams(**biased, thinking_budget=budget))
    assert free == [think] * 8
    # opened, three tokens of thinking, closed; then each new block is closed at once
    assert capped[0].outputs[0].token_ids == [think] * 4 + [end, think, end, think]
