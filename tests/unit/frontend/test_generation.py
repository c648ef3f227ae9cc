"""Fanned-out requests merged into one answer (frontend/generation.py), in-process over canned
postproc frames: a list of prompts (each with n choices) is one body or one stream with the
client's id, choices in order, usage summed, one [DONE]; a list of embedding inputs is one list;
one sub-request failing ends them all."""

from __future__ import annotations

import json

import msgspec
from starlette.testclient import TestClient

from common.openai_schema import (
    Completion,
    CompletionChoice,
    Embedding,
    EmbeddingList,
    EmbeddingUsage,
    PromptTokensDetails,
    Usage,
)
from common.protocol import Chunk, GenerateRequest, RequestFailed, decode_token_ids

MODEL = "builtin:tiny"
PROMPTS = ["The river", "Once upon a time", "Paris is"]


def usage_of(request: GenerateRequest) -> Usage:
    """What a postproc worker would count: the prompt's tokens, 3 per choice, 1 cached."""
    prompt = len(decode_token_ids(request.prompt_token_ids_b64))
    completion = 3 * request.sampling.n
    details = PromptTokensDetails(cached_tokens=1)
    return Usage(prompt_tokens=prompt, completion_tokens=completion,
                 total_tokens=prompt + completion, prompt_tokens_details=details)  # fmt: skip


def choices_of(request: GenerateRequest) -> list[CompletionChoice]:
    first = request.output.index_offset
    return [
        CompletionChoice(index=first + j, text=f"[{first + j}]", finish_reason="length")
        for j in range(request.sampling.n)
    ]


def completion(request: GenerateRequest, choices: list[CompletionChoice], **fields) -> bytes:
    body = Completion(id=request.output.response_id, created=request.output.created,
                      model=MODEL, choices=choices, **fields)  # fmt: skip
    return msgspec.json.encode(body)


def whole_body(request: GenerateRequest) -> list[Chunk]:
    usage = usage_of(request)
    data = completion(request, choices_of(request), usage=usage)
    ending = Chunk(request_id=request.request_id, data=data, done=True,
                   prompt_tokens=usage.prompt_tokens,
                   completion_tokens=usage.completion_tokens)  # fmt: skip
    return [ending]


def streamed(request: GenerateRequest) -> list[Chunk]:
    """A chunk per choice, then the ending: the usage chunk (include_usage) and [DONE]."""
    usage = usage_of(request)
    frames = [
        Chunk(request_id=request.request_id,
              data=b"data: " + completion(request, [choice], usage=None) + b"\n\n")
        for choice in choices_of(request)
    ]  # fmt: skip
    ending = b"data: " + completion(request, [], usage=usage) + b"\n\ndata: [DONE]\n\n"
    frames.append(Chunk(request_id=request.request_id, data=ending, done=True,
                        prompt_tokens=usage.prompt_tokens,
                        completion_tokens=usage.completion_tokens))  # fmt: skip
    return frames


def summed(fake) -> Usage:
    usages = [usage_of(request) for request in fake.submitted]
    prompt = sum(u.prompt_tokens for u in usages)
    completion = sum(u.completion_tokens for u in usages)
    return Usage(prompt_tokens=prompt, completion_tokens=completion,
                 total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=len(usages)))  # fmt: skip


def test_a_list_of_prompts_with_n_choices_is_one_body_usage_summed(http: TestClient, fake) -> None:
    fake.reply = whole_body
    body = {"model": MODEL, "prompt": PROMPTS, "n": 2, "max_tokens": 3}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    merged = msgspec.json.decode(response.content, type=Completion)
    client_id = fake.submitted[0].output.response_id
    assert [r.request_id for r in fake.submitted] == [f"{client_id}-{i}" for i in range(3)]
    assert merged.id == client_id  # one id, the client's
    assert [c.index for c in merged.choices] == list(range(6))
    assert [c.text for c in merged.choices] == [f"[{i}]" for i in range(6)]
    assert merged.usage == summed(fake)
    assert fake.open == {} and fake.aborted == []


def test_a_list_of_prompts_streams_every_choice_and_one_summed_ending(
    http: TestClient, fake
) -> None:
    fake.reply = streamed
    body = {"model": MODEL, "prompt": PROMPTS, "n": 2, "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    frames = response.text.split("\n\n")
    assert frames[-2:] == ["data: [DONE]", ""] and response.text.count("[DONE]") == 1
    chunks = [json.loads(f[len("data: ") :]) for f in frames[:-2]]
    client_id = fake.submitted[0].output.response_id
    assert {c["id"] for c in chunks} == {client_id}
    texts = {c["choices"][0]["index"]: c["choices"][0]["text"] for c in chunks[:-1]}
    assert texts == {i: f"[{i}]" for i in range(6)} and len(chunks) == 7
    assert chunks[-1]["choices"] == []
    assert msgspec.convert(chunks[-1]["usage"], Usage) == summed(fake)
    assert fake.open == {} and fake.aborted == []


def test_a_list_of_embedding_inputs_is_one_list_in_order_usage_summed(
    http: TestClient, fake
) -> None:
    def vector(request: GenerateRequest) -> list[Chunk]:
        ids = decode_token_ids(request.prompt_token_ids_b64)
        index = request.output.index_offset
        body = EmbeddingList(
            data=[Embedding(index=index, embedding=[float(index), 1.0])],
            model=MODEL,
            usage=EmbeddingUsage(prompt_tokens=len(ids), total_tokens=len(ids)),
        )
        return [Chunk(request_id=request.request_id, data=msgspec.json.encode(body), done=True,
                      prompt_tokens=len(ids))]  # fmt: skip

    fake.reply = vector
    inputs = [[1, 2, 3], [4, 5], [6]]
    response = http.post("/v1/embeddings", json={"model": MODEL, "input": inputs})
    assert response.status_code == 200, response.text
    merged = response.json()
    assert [d["index"] for d in merged["data"]] == [0, 1, 2]
    assert [d["embedding"] for d in merged["data"]] == [[0.0, 1.0], [1.0, 1.0], [2.0, 1.0]]
    assert merged["usage"] == {"prompt_tokens": 6, "total_tokens": 6}
    assert merged["object"] == "list" and merged["model"] == MODEL


def test_one_prompt_failing_fails_the_request_and_aborts_the_others(http: TestClient, fake) -> None:
    def second_fails(request: GenerateRequest) -> list:
        if request.request_id.endswith("-1"):
            return [RequestFailed(request_id=request.request_id, status_code=429,
                                  message="too many requests", code="overloaded")]  # fmt: skip
        return whole_body(request)

    fake.reply = second_fails
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPTS})
    assert response.status_code == 429 and response.headers["retry-after"] == "1"
    error = response.json()["error"]
    assert error["message"] == "too many requests" and error["code"] == "overloaded"
    assert fake.aborted == [r.request_id for r in fake.submitted] and fake.open == {}
