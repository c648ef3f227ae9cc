"""Fanned-out requests merged into one answer (frontend/generation.py), in-process over canned
postproc frames (and over a real postproc worker): a list of prompts (each with n choices) is one
body or one stream with the client's id, choices in order, usage summed from the ending Chunks'
numbers, one ending written by the frontend; a list of embedding inputs is one list; one
sub-request failing ends them all."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
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
from common.protocol import (
    Chunk,
    GenerateRequest,
    RequestFailed,
    TokenBatch,
    TokenDelta,
    decode_token_ids,
    pack_postproc_start,
)
from common.stage_times import StageTimes
from common.tokenizer import load_tokenizer
from postproc_worker.worker import PostprocWorker

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


def times_of(request: GenerateRequest) -> StageTimes:
    """Each prompt slower than the one before at prefill, faster at decode."""
    first = request.output.index_offset
    return StageTimes(prefill_s=0.1 * (first + 1), decode_s=1.0 / (first + 1))


def ending_of(request: GenerateRequest, data: bytes) -> Chunk:
    """The last Chunk, with the usage as numbers."""
    usage = usage_of(request)
    return Chunk(request_id=request.request_id, data=data, done=True,
                 prompt_tokens=usage.prompt_tokens, cached_tokens=1,
                 completion_tokens=usage.completion_tokens, times=times_of(request))  # fmt: skip


def whole_body(request: GenerateRequest) -> list[Chunk]:
    data = completion(request, choices_of(request), usage=usage_of(request))
    return [ending_of(request, data)]


def streamed(request: GenerateRequest) -> list[Chunk]:
    """A chunk per choice, then the ending: none of its own for one of a prompt list's streams
    (the frontend writes it), else the usage chunk (include_usage) and [DONE]."""
    frames = [
        Chunk(request_id=request.request_id,
              data=b"data: " + completion(request, [choice], usage=None) + b"\n\n")
        for choice in choices_of(request)
    ]  # fmt: skip
    usage = completion(request, [], usage=usage_of(request))
    own = b"data: " + usage + b"\n\ndata: [DONE]\n\n"
    frames.append(ending_of(request, b"" if request.output.fanned_out else own))
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
    assert "perf_metrics" not in chunks[-1]
    assert all(r.output.fanned_out for r in fake.submitted)
    assert fake.open == {} and fake.aborted == []


def test_a_prompt_list_streams_perf_metrics_without_usage_as_each_stage_s_slowest(
    http: TestClient, fake
) -> None:
    fake.reply = streamed
    body = {"model": MODEL, "prompt": PROMPTS, "max_tokens": 3, "stream": True,
            "return_perf_metrics": True}  # fmt: skip
    response = http.post("/v1/completions", json=body)
    frames = response.text.split("\n\n")
    assert frames[-2:] == ["data: [DONE]", ""] and response.text.count("[DONE]") == 1
    last = json.loads(frames[-3].removeprefix("data: "))
    assert last["choices"] == [] and "usage" not in last
    assert last["perf_metrics"]["prefill_s"] == pytest.approx(0.3)  # the third prompt's
    assert last["perf_metrics"]["decode_s"] == pytest.approx(1.0)  # the first's


def test_a_prompt_list_streamed_without_usage_ends_with_done_alone(http: TestClient, fake) -> None:
    fake.reply = streamed
    body = {"model": MODEL, "prompt": PROMPTS, "max_tokens": 3, "stream": True}
    response = http.post("/v1/completions", json=body)
    frames = response.text.split("\n\n")
    assert frames[-2:] == ["data: [DONE]", ""] and response.text.count("[DONE]") == 1
    assert all(json.loads(f.removeprefix("data: "))["choices"] for f in frames[:-2])
    assert len(frames) == len(PROMPTS) + 2


def test_one_prompt_is_not_fanned_out_and_its_stream_is_relayed_as_sent(
    http: TestClient, fake
) -> None:
    fake.reply = streamed
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    response = http.post("/v1/completions", json=body)
    (request,) = fake.submitted
    assert not request.output.fanned_out
    assert response.content == b"".join(c.data for c in streamed(request))


@pytest.fixture
def real_postproc(tiny_model_path: Path) -> Callable[[GenerateRequest], list[Chunk]]:
    """What a real postproc worker sends for a request: each choice's first token (the prompt
    counted, 1 token cached, times), then two more and the end."""
    tokenizer = load_tokenizer(tiny_model_path)

    def reply(request: GenerateRequest) -> list[Chunk]:
        worker = PostprocWorker(tokenizer)
        rid, n = request.request_id, request.sampling.n
        num_prompt = len(decode_token_ids(request.prompt_token_ids_b64))
        start = pack_postproc_start(request.postproc_start())
        firsts = [TokenDelta(rid, j, [72], num_prompt_tokens=num_prompt, num_cached_tokens=1,
                             times=times_of(request)) for j in range(n)]  # fmt: skip
        lasts = [TokenDelta(rid, j, [73, 74], finish_reason="length") for j in range(n)]
        out = worker.handle(TokenBatch(starts=[start], deltas=firsts), 0.0)
        out += worker.handle(TokenBatch(deltas=lasts), 0.0)
        return [message for _, message in out if isinstance(message, Chunk)]

    return reply


def test_a_prompt_list_over_real_postproc_workers_ends_as_one_prompt_does(
    http: TestClient, fake, real_postproc: Callable[[GenerateRequest], list[Chunk]]
) -> None:
    sent: list[Chunk] = []

    def reply(request: GenerateRequest) -> list[Chunk]:
        chunks = real_postproc(request)
        sent.extend(chunks)
        return chunks

    fake.reply = reply
    body = {"model": MODEL, "n": 2, "max_tokens": 3, "stream": True, "return_perf_metrics": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    one = http.post("/v1/completions", json={**body, "prompt": PROMPTS[0]}).text.split("\n\n")
    sent.clear()
    many = http.post("/v1/completions", json={**body, "prompt": PROMPTS}).text.split("\n\n")
    assert one[-2:] == many[-2:] == ["data: [DONE]", ""] and many.count("data: [DONE]") == 1
    # every choice's frame as its worker wrote it, then the ending
    relayed = [f for c in sent for f in c.data.decode().split("\n\n") if f]
    assert sorted(many[:-3]) == sorted(relayed)
    last_one, last_many = (json.loads(f[-3].removeprefix("data: ")) for f in (one, many))
    assert list(last_many) == list(last_one)  # the same fields, in the same order
    assert list(last_many["usage"]) == list(last_one["usage"])
    prompts = [len(decode_token_ids(r.prompt_token_ids_b64)) for r in fake.submitted[1:]]
    assert last_many["usage"] == {
        "prompt_tokens": sum(prompts),
        "completion_tokens": 3 * 2 * len(PROMPTS),
        "total_tokens": sum(prompts) + 3 * 2 * len(PROMPTS),
        "prompt_tokens_details": {"cached_tokens": len(PROMPTS)},
    }
    assert last_many["id"] == fake.submitted[1].output.response_id and last_many["choices"] == []
    assert last_many["perf_metrics"]["prefill_s"] == pytest.approx(0.1 * (2 * 2 + 1))


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
