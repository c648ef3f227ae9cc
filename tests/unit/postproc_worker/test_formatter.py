"""OpenAI bytes from token deltas, checked with the `openai` SDK's own types and stream parser."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import httpx2
import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from common.protocol import GenerateRequest, OutputOptions, TokenDelta, encode_token_ids
from common.sampling_params import SamplingParams
from common.stage_times import StageTimes
from common.tokenizer import Tokenizer, load_tokenizer
from postproc_worker.formatter import RequestState, StepOutput
from postproc_worker.openai_frames import MIN_LOGPROB

PROMPT = "Tell me something nice:"
OUTPUT = "Sure! 你好，世界 🎉 — the sky is blue. ###END and more"
MODEL = "tiny"
CREATED = 1_700_000_000
NUM_CACHED = 3


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path: Path) -> Tokenizer:
    return load_tokenizer(tiny_model_path)


def make_state(
    tokenizer: Tokenizer,
    *,
    kind: Literal["completion", "chat"] = "completion",
    stream: bool = True,
    n: int = 1,
    stop: Sequence[str] = (),
    logprobs: int | None = None,
    echo: bool = False,
    include_usage: bool = False,
    skip_special_tokens: bool = True,
    min_tokens: int = 0,
    perf_metrics: bool = False,
) -> RequestState:
    request = GenerateRequest(
        request_id=("chatcmpl-" if kind == "chat" else "cmpl-") + "abc123",
        prompt_token_ids_b64=encode_token_ids(tokenizer.encode(PROMPT)),
        sampling=SamplingParams(n=n, logprobs=logprobs, min_tokens=min_tokens, max_tokens=64),
        output=OutputOptions(
            kind=kind,
            model=MODEL,
            created=CREATED,
            stream=stream,
            include_usage=include_usage,
            echo_prompt=PROMPT if echo else None,
            stop=list(stop),
            skip_special_tokens=skip_special_tokens,
            perf_metrics=perf_metrics,
        ),
        reply_to="tcp://127.0.0.1:5999",
    )
    return RequestState(request.postproc_start(), tokenizer)


def fake_logprob(position: int) -> float:
    return -0.25 - 0.01 * position


def deltas(
    token_ids: list[int],
    *,
    index: int = 0,
    finish_reason: str | None = "length",
    cuts: Sequence[int] | None = None,
    logprobs: bool = False,
) -> list[TokenDelta]:
    """One delta per token (or per piece between `cuts`); the last carries the finish reason."""
    bounds = [0, *(cuts if cuts is not None else range(1, len(token_ids))), len(token_ids)]
    out = []
    for start, end in zip(bounds, bounds[1:], strict=False):
        ids = token_ids[start:end]
        lps = [fake_logprob(k) for k in range(start, end)]
        tops = [
            [(t, lp), (48 if t != 48 else 49, lp - 1.0), (7, float("-inf"))]
            for t, lp in zip(ids, lps, strict=True)
        ]
        out.append(
            TokenDelta(
                request_id="r",
                index=index,
                token_ids=ids,
                logprobs=lps if logprobs else None,
                top_logprobs=tops if logprobs else None,
                num_prompt_tokens=0,
                num_cached_tokens=NUM_CACHED,
            )
        )
    out[-1].finish_reason = finish_reason
    return out


def feed(state: RequestState, all_deltas: list[TokenDelta]) -> tuple[bytes, list[StepOutput]]:
    outputs = [state.add(d) for d in all_deltas]
    return b"".join(o.data for o in outputs), outputs


def sse_payloads(data: bytes) -> list[str]:
    """The payload of each `data: ...\\n\\n` frame, checking the framing on the way."""
    assert data.endswith(b"\n\n")
    frames = data[:-2].split(b"\n\n")
    assert all(f.startswith(b"data: ") and b"\n" not in f for f in frames)
    payloads = [f[len(b"data: ") :].decode() for f in frames]
    assert payloads[-1] == "[DONE]" and "[DONE]" not in payloads[:-1]
    return payloads[:-1]


def sdk_stream(data: bytes, kind: str) -> list[Any]:
    """Let the official client parse our bytes exactly as it parses a server's SSE response."""

    def handler(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, content=data, headers={"content-type": "text/event-stream"})

    client = openai.OpenAI(
        api_key="test",
        base_url="http://postproc.test/v1",
        http_client=httpx2.Client(transport=httpx2.MockTransport(handler)),
    )
    if kind == "chat":
        messages: Any = [{"role": "user", "content": PROMPT}]
        return list(client.chat.completions.create(model=MODEL, messages=messages, stream=True))
    return list(client.completions.create(model=MODEL, prompt=PROMPT, stream=True))


def chunk_texts(chunks: list[Any], kind: str, index: int = 0) -> str:
    if kind == "chat":
        return "".join(
            c.delta.content or "" for ch in chunks for c in ch.choices if c.index == index
        )
    return "".join(c.text for ch in chunks for c in ch.choices if c.index == index)


# --- streaming ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_streamed_chunks_parse_with_the_openai_sdk(tokenizer: Tokenizer, kind: str) -> None:
    token_ids = tokenizer.encode(OUTPUT)
    state = make_state(tokenizer, kind=kind)  # type: ignore[arg-type]
    data, outputs = feed(state, deltas(token_ids))
    assert [o.done for o in outputs] == [False] * (len(outputs) - 1) + [True]
    assert not any(o.abort_upstream for o in outputs)

    chunks = sdk_stream(data, kind)
    assert chunk_texts(chunks, kind) == tokenizer.decode(token_ids)
    assert all(
        ch.id == state.request_id and ch.model == MODEL and ch.created == CREATED for ch in chunks
    )
    assert [c.finish_reason for ch in chunks for c in ch.choices][-1] == "length"
    assert all(c.finish_reason is None for ch in chunks[:-1] for c in ch.choices)
    for payload in sse_payloads(data):
        assert "usage" not in json.loads(payload)  # only with stream_options.include_usage
        assert "\ufffd" not in payload


def test_chat_stream_starts_with_the_role_and_validates_strictly(tokenizer: Tokenizer) -> None:
    token_ids = tokenizer.encode(OUTPUT)
    data, _ = feed(make_state(tokenizer, kind="chat"), deltas(token_ids))
    chunks = [ChatCompletionChunk.model_validate_json(p) for p in sse_payloads(data)]
    assert chunks[0].object == "chat.completion.chunk"
    first = chunks[0].choices[0]
    assert first.delta.role == "assistant" and first.delta.content == ""
    assert all(ch.choices[0].delta.role is None for ch in chunks[1:])
    assert chunks[-1].choices[0].finish_reason == "length"


def test_completion_stream_final_chunk_validates_strictly(tokenizer: Tokenizer) -> None:
    data, _ = feed(make_state(tokenizer), deltas(tokenizer.encode("Hi there")))
    final = Completion.model_validate_json(sse_payloads(data)[-1])  # finish_reason is not null
    assert final.object == "text_completion" and final.choices[0].finish_reason == "length"


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_include_usage_adds_a_usage_chunk_counting_all_choices(
    tokenizer: Tokenizer, kind: str
) -> None:
    first = tokenizer.encode("one two three")
    second = [*tokenizer.encode("four five"), tokenizer.eos_token_id]
    state = make_state(tokenizer, kind=kind, n=2, include_usage=True)  # type: ignore[arg-type]
    data, _ = feed(state, deltas(first, index=0) + deltas(second, index=1, finish_reason="stop"))
    payloads = [json.loads(p) for p in sse_payloads(data)]
    assert all("usage" in p and p["usage"] is None for p in payloads[:-1])
    assert payloads[-1]["choices"] == []

    usage = sdk_stream(data, kind)[-1].usage
    num_prompt = len(tokenizer.encode(PROMPT))
    assert usage.prompt_tokens == num_prompt
    assert usage.completion_tokens == len(first) + len(second)
    assert usage.total_tokens == num_prompt + len(first) + len(second)
    assert usage.prompt_tokens_details.cached_tokens == NUM_CACHED


def test_n_choices_stream_interleaved_and_finish_together(tokenizer: Tokenizer) -> None:
    a, b = tokenizer.encode("Alpha beta 世界"), tokenizer.encode("Gamma δέλτα")
    da, db = deltas(a, index=0), deltas(b, index=1)
    interleaved = [d for pair in zip(da, db, strict=False) for d in pair]
    interleaved += da[len(db) :] + db[len(da) :]
    state = make_state(tokenizer, kind="chat", n=2)
    data, outputs = feed(state, interleaved)
    assert sum(o.done for o in outputs) == 1 and outputs[-1].done
    chunks = [ChatCompletionChunk.model_validate_json(p) for p in sse_payloads(data)]
    assert chunk_texts(chunks, "chat", 0) == tokenizer.decode(a)
    assert chunk_texts(chunks, "chat", 1) == tokenizer.decode(b)
    roles = [c.index for ch in chunks for c in ch.choices if c.delta.role == "assistant"]
    assert roles == [0, 1]


# --- non-streaming --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_non_streaming_body_with_two_choices(tokenizer: Tokenizer, kind: str) -> None:
    first = tokenizer.encode(OUTPUT)
    second = [*tokenizer.encode("短い答え"), tokenizer.eos_token_id]  # ends with EOS: "stop"
    state = make_state(tokenizer, kind=kind, stream=False, n=2)  # type: ignore[arg-type]
    data, outputs = feed(state, deltas(second, index=1, finish_reason="stop") + deltas(first))
    assert all(o.data == b"" for o in outputs[:-1]) and outputs[-1].done
    body: Any = (ChatCompletion if kind == "chat" else Completion).model_validate_json(data)
    assert body.id == state.request_id and body.model == MODEL and body.created == CREATED
    assert [c.index for c in body.choices] == [0, 1]
    texts = [c.message.content if kind == "chat" else c.text for c in body.choices]
    assert texts == [tokenizer.decode(first), "短い答え"]
    assert [c.finish_reason for c in body.choices] == ["length", "stop"]
    assert body.usage.completion_tokens == len(first) + len(second)
    assert body.usage.total_tokens == body.usage.prompt_tokens + len(first) + len(second)
    assert body.usage.prompt_tokens_details.cached_tokens == NUM_CACHED
    if kind == "chat":
        assert body.object == "chat.completion" and body.choices[0].message.role == "assistant"


def test_eos_token_ends_the_text_without_showing_it(tokenizer: Tokenizer) -> None:
    token_ids = [*tokenizer.encode("Done."), tokenizer.eos_token_id]
    state = make_state(tokenizer, kind="chat", stream=False, skip_special_tokens=False)
    data, _ = feed(state, deltas(token_ids, finish_reason="stop"))
    body = ChatCompletion.model_validate_json(data)
    assert body.choices[0].message.content == "Done."
    assert body.usage is not None and body.usage.completion_tokens == len(token_ids)


def test_special_tokens_are_shown_when_not_skipped(tokenizer: Tokenizer) -> None:
    token_ids = tokenizer.encode("a<|im_start|>b<think>c</think>")
    for skip, expected in [(True, "ab<think>c</think>"), (False, "a<|im_start|>b<think>c</think>")]:
        state = make_state(tokenizer, stream=False, skip_special_tokens=skip)
        data, _ = feed(state, deltas(token_ids))
        assert Completion.model_validate_json(data).choices[0].text == expected


# --- stop strings ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_stop_string_split_at_every_token_boundary(tokenizer: Tokenizer, kind: str) -> None:
    token_ids = tokenizer.encode(OUTPUT)
    expected = OUTPUT[: OUTPUT.index("###")]
    for cut in range(1, len(token_ids)):
        state = make_state(tokenizer, kind=kind, stop=["###END"])  # type: ignore[arg-type]
        data, outputs = feed(state, deltas(token_ids, cuts=[cut], finish_reason=None))
        assert [o.abort_upstream for o in outputs].count(True) == 1  # once, when it became done
        assert next(o for o in outputs if o.done).abort_upstream
        chunks = sdk_stream(data, kind)
        assert chunk_texts(chunks, kind) == expected
        assert [c.finish_reason for ch in chunks for c in ch.choices][-1] == "stop"
        shown = ""
        for payload in sse_payloads(data):
            for choice in json.loads(payload)["choices"]:
                shown += choice["delta"].get("content", "") if kind == "chat" else choice["text"]
                assert expected.startswith(shown)  # no part of "###END" was ever sent


def test_stop_string_ends_the_request_in_the_middle_of_a_step(tokenizer: Tokenizer) -> None:
    token_ids = tokenizer.encode("one. two. three.")
    state = make_state(tokenizer, stream=False, stop=[". t"])
    data, outputs = feed(state, deltas(token_ids, cuts=[], finish_reason=None))  # a single step
    body = Completion.model_validate_json(data)
    assert body.choices[0].text == "one" and body.choices[0].finish_reason == "stop"
    assert outputs[-1].abort_upstream
    assert body.usage is not None and body.usage.completion_tokens < len(token_ids)


def test_no_abort_when_the_engine_finished_on_the_matching_step(tokenizer: Tokenizer) -> None:
    state = make_state(tokenizer, stop=["###"])
    _, outputs = feed(state, deltas(tokenizer.encode("abc ###"), finish_reason="length"))
    assert outputs[-1].done and not outputs[-1].abort_upstream


def test_stopped_choice_waits_for_the_other_choices(tokenizer: Tokenizer) -> None:
    stopped, running = tokenizer.encode("first### ignored"), tokenizer.encode("second choice")
    state = make_state(tokenizer, kind="chat", stream=False, n=2, stop=["###"])
    stopped_deltas = deltas(stopped, index=0, finish_reason=None)
    outputs = [state.add(d) for d in stopped_deltas]
    assert not any(o.done or o.abort_upstream for o in outputs)
    data, outputs = feed(state, deltas(running, index=1, finish_reason="length"))
    assert outputs[-1].done and outputs[-1].abort_upstream  # choice 0 is still decoding upstream
    body = ChatCompletion.model_validate_json(data)
    assert [c.message.content for c in body.choices] == ["first", "second choice"]
    assert [c.finish_reason for c in body.choices] == ["stop", "length"]
    consumed = len(tokenizer.encode("first###"))
    assert body.usage is not None
    assert consumed <= body.usage.completion_tokens - len(running) < len(stopped)


def test_held_stop_prefix_is_released_when_the_choice_ends_by_length(tokenizer: Tokenizer) -> None:
    token_ids = tokenizer.encode("the end ##")
    data, _ = feed(make_state(tokenizer, stop=["###"]), deltas(token_ids))
    assert chunk_texts(sdk_stream(data, "completion"), "completion") == "the end ##"


def test_stop_strings_wait_for_min_tokens(tokenizer: Tokenizer) -> None:
    token_ids = tokenizer.encode("a. b. c. d")
    state = make_state(tokenizer, stream=False, stop=["."], min_tokens=3)
    data, _ = feed(state, deltas(token_ids))
    assert Completion.model_validate_json(data).choices[0].text == "a. b"


# --- logprobs -------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False])
def test_completion_logprobs_shape(tokenizer: Tokenizer, stream: bool) -> None:
    token_ids = tokenizer.encode(OUTPUT)
    state = make_state(tokenizer, stream=stream, logprobs=2)
    data, _ = feed(state, deltas(token_ids, logprobs=True))
    if stream:
        choices = [c for ch in sdk_stream(data, "completion") for c in ch.choices]
    else:
        choices = Completion.model_validate_json(data).choices
    text = "".join(c.text for c in choices)
    tokens = [t for c in choices for t in c.logprobs.tokens]
    token_logprobs = [lp for c in choices for lp in c.logprobs.token_logprobs]
    top = [d for c in choices for d in c.logprobs.top_logprobs]
    offsets = [o for c in choices for o in c.logprobs.text_offset]
    assert tokens == [tokenizer.token_text(t) for t in token_ids]
    assert token_logprobs == pytest.approx([fake_logprob(k) for k in range(len(token_ids))])
    assert all(len(d) <= 3 and d[tokens[k]] == token_logprobs[k] for k, d in enumerate(top))
    assert MIN_LOGPROB not in [v for d in top for v in d.values()]  # -inf was third: beyond k=2
    assert offsets == sorted(offsets) and offsets[0] == 0
    for token, offset in zip(tokens, offsets, strict=True):
        if "\ufffd" not in token:
            assert text[offset : offset + len(token)] == token


def test_chat_logprobs_shape_with_exact_bytes_and_no_infinity(tokenizer: Tokenizer) -> None:
    token_ids = tokenizer.encode(OUTPUT)
    state = make_state(tokenizer, kind="chat", logprobs=3)
    data, _ = feed(state, deltas(token_ids, logprobs=True, cuts=[2, 5, 9]))
    assert b"Infinity" not in data and b"NaN" not in data
    chunks = [ChatCompletionChunk.model_validate_json(p) for p in sse_payloads(data)]
    entries = [
        e for ch in chunks for c in ch.choices if c.logprobs for e in c.logprobs.content or []
    ]
    assert len(entries) == len(token_ids)
    assert b"".join(bytes(e.bytes or []) for e in entries) == OUTPUT.encode()
    assert all(len(e.top_logprobs) == 3 for e in entries)
    assert all(e.top_logprobs[2].logprob == MIN_LOGPROB for e in entries)
    assert entries[0].top_logprobs[0].token == entries[0].token


def test_chat_non_streaming_logprobs(tokenizer: Tokenizer) -> None:
    token_ids = tokenizer.encode("Hello, world")
    state = make_state(tokenizer, kind="chat", stream=False, logprobs=0)
    data, _ = feed(state, deltas(token_ids, logprobs=True))
    logprobs = ChatCompletion.model_validate_json(data).choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert [e.token for e in logprobs.content] == [tokenizer.token_text(t) for t in token_ids]
    assert all(e.top_logprobs == [] for e in logprobs.content)


# --- echo and odd deltas --------------------------------------------------------------------------


def test_echo_prepends_the_prompt(tokenizer: Tokenizer) -> None:
    token_ids = tokenizer.encode(" and then some")
    data, _ = feed(make_state(tokenizer, echo=True, logprobs=1), deltas(token_ids, logprobs=True))
    chunks = sdk_stream(data, "completion")
    assert chunks[0].choices[0].text.startswith(PROMPT)
    assert chunk_texts(chunks, "completion") == PROMPT + " and then some"
    assert chunks[0].choices[0].logprobs.text_offset[0] == len(PROMPT)

    data, _ = feed(
        make_state(tokenizer, echo=True, stream=False, n=2),
        deltas(token_ids, index=0) + deltas(token_ids, index=1),
    )
    body = Completion.model_validate_json(data)
    assert [c.text for c in body.choices] == [PROMPT + " and then some"] * 2


def test_finish_without_tokens_and_late_deltas(tokenizer: Tokenizer) -> None:
    state = make_state(tokenizer, kind="chat")
    first = state.add(deltas(tokenizer.encode("partial"), finish_reason=None)[0])
    assert not first.done
    end = state.add(TokenDelta(request_id="r", index=0, token_ids=[], finish_reason="abort"))
    assert end.done and not end.abort_upstream and end.data.endswith(b"data: [DONE]\n\n")
    late = state.add(deltas(tokenizer.encode("late"))[0])
    assert late.data == b"" and late.done


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_perf_metrics_are_the_last_stage_times_received(tokenizer: Tokenizer, kind: str) -> None:
    """The first token's delta carries the stages up to it, the last one every stage; a stop
    string that ends the request here shows what had arrived by then."""
    first = StageTimes(queue_s=0.01, prefill_s=0.2, first_token_s=0.3)
    every = StageTimes(queue_s=0.01, prefill_s=0.2, transfer_s=0.05, first_token_s=0.3, decode_s=1)
    token_ids = tokenizer.encode("one. two. three.")
    stream = make_state(tokenizer, kind=kind, perf_metrics=True)  # type: ignore[arg-type]
    steps = deltas(token_ids)
    steps[0].times, steps[-1].times = first, every
    data, _ = feed(stream, steps)
    *chunks, last = [json.loads(p) for p in sse_payloads(data)]
    assert last["choices"] == [] and "usage" not in last
    assert StageTimes(**last["perf_metrics"]) == every
    assert all("perf_metrics" not in c for c in chunks)
    sdk_stream(data, kind)  # the official client takes the extra chunk
    stopped = make_state(tokenizer, kind=kind, stream=False, stop=[". t"], perf_metrics=True)  # type: ignore[arg-type]
    steps = deltas(token_ids, finish_reason=None)
    steps[0].times = first
    body, _ = feed(stopped, steps)
    assert StageTimes(**json.loads(body)["perf_metrics"]) == first
    assert stopped.times == first
