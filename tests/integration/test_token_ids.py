"""The seed's token-level interfaces on a disaggregated cluster: `return_token_ids` (vLLM's name)
in bodies and stream chunks, and chat's `prompt_token_ids` pass-through, which skips the template
and gives the same output as the messages it stands for."""

from __future__ import annotations

import json

import httpx
import pytest

from common.protocol import encode_token_ids
from tests.integration.harness import MODEL, Cluster

ASK = [{"role": "user", "content": "Tell me about the river."}]
GREEDY = {"model": MODEL, "temperature": 0, "max_tokens": 6, "ignore_eos": True}


@pytest.fixture(scope="module")
def cluster(start_cluster) -> Cluster:
    return start_cluster("disaggregated")


def post(cluster: Cluster, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{cluster.base_url}/{route}", json=body, timeout=60)


def stream_chunks(cluster: Cluster, route: str, body: dict) -> list[dict]:
    chunks = []
    with httpx.stream("POST", f"{cluster.base_url}/{route}", json={**body, "stream": True},
                      timeout=60) as response:  # fmt: skip
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: ") :]))
    return chunks


def detokenize(cluster: Cluster, ids: list[int]) -> str:
    return post(cluster, "detokenize", {"model": MODEL, "tokens": ids}).json()["prompt"]


def test_chat_returns_the_prompt_and_output_ids_streamed_and_not(cluster: Cluster) -> None:
    body = {**GREEDY, "messages": ASK, "return_token_ids": True}
    answer = post(cluster, "chat/completions", body).json()
    expected_prompt = post(cluster, "tokenize", {"model": MODEL, "messages": ASK}).json()["tokens"]
    assert answer["prompt_token_ids"] == expected_prompt
    choice = answer["choices"][0]
    assert len(choice["token_ids"]) == answer["usage"]["completion_tokens"] == 6
    assert detokenize(cluster, choice["token_ids"]) == choice["message"]["content"]
    chunks = stream_chunks(cluster, "chat/completions", body)
    assert chunks[0]["prompt_token_ids"] == expected_prompt
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    streamed = [i for c in chunks for ch in c["choices"] for i in ch.get("token_ids", [])]
    assert streamed == choice["token_ids"]
    plain = post(cluster, "chat/completions", {**GREEDY, "messages": ASK}).json()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]


def test_completions_return_the_ids_in_each_choice(cluster: Cluster) -> None:
    body = {**GREEDY, "prompt": "The river", "n": 2, "return_token_ids": True}
    answer = post(cluster, "completions", body).json()
    prompt = post(cluster, "tokenize", {"model": MODEL, "prompt": "The river"}).json()["tokens"]
    for choice in answer["choices"]:
        assert choice["prompt_token_ids"] == prompt
        assert detokenize(cluster, choice["token_ids"]) == choice["text"]
    chunks = stream_chunks(cluster, "completions", {**body, "n": 1})
    firsts = [ch for c in chunks for ch in c["choices"] if "prompt_token_ids" in ch]
    assert len(firsts) == 1 and firsts[0]["prompt_token_ids"] == prompt
    streamed = [i for c in chunks for ch in c["choices"] for i in ch.get("token_ids", [])]
    assert streamed == answer["choices"][0]["token_ids"]


def test_chat_prompt_token_ids_skip_the_template_and_give_the_same_answer(cluster: Cluster) -> None:
    first = post(cluster, "chat/completions", {**GREEDY, "messages": ASK, "return_token_ids": True})
    ids = first.json()["prompt_token_ids"]
    for given in ({"prompt_token_ids": ids}, {"prompt_token_ids_b64": encode_token_ids(ids)}):
        again = post(cluster, "chat/completions", {**GREEDY, "messages": ASK, **given}).json()
        assert again["choices"][0]["message"] == first.json()["choices"][0]["message"]
        assert again["usage"]["prompt_tokens"] == len(ids)
    # other ids: the messages are not rendered, the ids are the prompt
    other = post(cluster, "tokenize", {"model": MODEL, "prompt": "Hello there"}).json()["tokens"]
    answer = post(
        cluster, "chat/completions", {**GREEDY, "messages": ASK, "prompt_token_ids": other}
    )
    assert answer.json()["usage"]["prompt_tokens"] == len(other)
