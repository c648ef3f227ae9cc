"""Speculative decoding (cluster.yaml `speculative`: n-gram proposals, and a draft model: the
served model drafting for itself) through a real cluster in both modes: greedy completions,
streamed or not, with log-probs and a stop string, equal one engine in process without
speculation; proposals are accepted (the spec_decode counters in /metrics); beam search is a 400;
nothing is held after."""

from __future__ import annotations

from collections.abc import Callable

import openai
import pytest

from common.sampling_params import SamplingParams
from engine.llm import LLM
from tests.integration.harness import MODEL, Cluster
from tests.integration.test_observability import metrics

pytestmark = pytest.mark.long

MAX_NEW = 40
SPECULATIVE = {
    "ngram": "speculative: {method: ngram, num_speculative_tokens: 4, prompt_lookup_max: 3}\n",
    "draft_model": f"speculative: {{method: draft_model, model: '{MODEL}', "
    "num_speculative_tokens: 4}\n",
}
# prompts the tiny model copies from (proposals accepted) and one it does not
PROMPTS = [
    "one two three four five one two three four five one two three four five one two",
    "def f(x):\n    return x + 1\n\ndef f(x):\n    return x + 1\n\ndef f(x):\n",
    "The capital of France is",
]


@pytest.fixture(scope="module")
def expected() -> list[tuple[list[int], list[float], str]]:
    """Token ids, log-probs and text of each prompt's greedy completion, without speculation."""
    llm = LLM(MODEL, block_size=16, num_blocks=512)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=1, ignore_eos=True)
    return [
        (r.outputs[0].token_ids, r.outputs[0].logprobs, r.outputs[0].text)
        for r in llm.generate(PROMPTS, params)
    ]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("mode", ["aggregated", "disaggregated"])
def test_greedy_completions_equal_without_speculation_and_nothing_is_held(
    mode: str,
    method: str,
    start_cluster: Callable[..., Cluster],
    expected: list[tuple[list[int], list[float], str]],
) -> None:
    cluster = start_cluster(mode, extra=SPECULATIVE[method])
    client = openai.OpenAI(base_url=cluster.base_url, api_key="-", timeout=60, max_retries=0)
    options = {"model": MODEL, "max_tokens": MAX_NEW, "temperature": 0, "logprobs": 1}
    body = {"return_token_ids": True, "ignore_eos": True}
    for prompt, (tokens, logprobs, text) in zip(PROMPTS, expected, strict=True):
        result = client.completions.create(prompt=prompt, extra_body=body, **options)
        choice = result.choices[0]
        assert list(choice.token_ids) == tokens  # type: ignore[attr-defined]
        assert choice.logprobs is not None
        assert choice.logprobs.token_logprobs == pytest.approx(logprobs, abs=1e-4)
        streamed = client.completions.create(prompt=prompt, extra_body=body, stream=True, **options)
        assert "".join(c.choices[0].text for c in streamed if c.choices) == choice.text == text
    # a stop string inside a run of accepted proposals: the text ends before it
    prompt, text = PROMPTS[0], expected[0][2]
    stop = text[len(text) // 2 :].split()[0]
    cut = client.completions.create(prompt=prompt, stop=[stop], extra_body=body, **options)
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError, match="speculative"):
        client.completions.create(prompt=prompt, best_of=2, extra_body={"use_beam_search": True},
                                  **options)  # fmt: skip
    info = cluster.wait_idle()
    busy = [w for w in info.workers if w.blocks_used or w.blocks_leased or w.active_requests]
    assert not busy, busy
    decoders = [w for w in info.workers if w.role == "generation"]
    assert sum(w.spec_decode_num_accepted_tokens for w in decoders) > MAX_NEW
    scrape = metrics(cluster)
    accepted = scrape["pdcluster_spec_decode_num_accepted_tokens_total"]
    proposed = scrape["pdcluster_spec_decode_num_draft_tokens_total"]
    assert 0 < sum(accepted.values()) <= sum(proposed.values())
