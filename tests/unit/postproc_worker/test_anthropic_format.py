"""Anthropic Messages bytes from token deltas, checked with the `anthropic` SDK's own types and
stream parser."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anthropic
import httpx2
import pydantic
import pytest
from anthropic.types import Message, RawMessageStreamEvent

from common.parser_choice import ParserState
from common.protocol import (
    GenerateRequest,
    OutputOptions,
    TokenDelta,
    decode,
    encode,
    encode_token_ids,
    pack_postproc_start,
    unpack_postproc_start,
)
from common.sampling_params import SamplingParams
from common.tokenizer import Tokenizer, load_tokenizer
from postproc_worker.formatter import RequestState, StepOutput

PROMPT = "Tell me something nice:"
OUTPUT = "Sure! 你好，世界 🎉 — the sky is blue. ###END and more"
MODEL = "tiny"
MESSAGE_ID = "msg_abc123"
NUM_CACHED = 3
EVENTS = pydantic.TypeAdapter(RawMessageStreamEvent)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path: Path) -> Tokenizer:
    return load_tokenizer(tiny_model_path)


def make_state(
    tokenizer: Tokenizer,
    *,
    stream: bool,
    stop: Sequence[str] = (),
    parser_state: ParserState | None = None,
) -> RequestState:
    output = OutputOptions(
        kind="anthropic",
        model=MODEL,
        stream=stream,
        stop=list(stop),
        parser_state=parser_state,
    )
    request = GenerateRequest(
        request_id=MESSAGE_ID,
        prompt_token_ids_b64=encode_token_ids(tokenizer.encode(PROMPT)),
        sampling=SamplingParams(max_tokens=64),
        output=output,
        reply_to="tcp://127.0.0.1:5999",
    )
    wired = decode(encode(request))  # as the orchestrator receives it
    assert isinstance(wired, GenerateRequest) and wired.output.kind == "anthropic"
    # and the postproc worker its part, through an engine worker
    return RequestState(
        unpack_postproc_start(pack_postproc_start(wired.postproc_start())), tokenizer
    )


def deltas(
    token_ids: list[int], *, finish_reason: str | None, cuts: Sequence[int] | None = None
) -> list[TokenDelta]:
    """One delta per token (or per piece between `cuts`); the last carries the finish reason."""
    bounds = [0, *(cuts if cuts is not None else range(1, len(token_ids))), len(token_ids)]
    out = [
        TokenDelta(request_id=MESSAGE_ID, index=0, token_ids=token_ids[start:end])
        for start, end in zip(bounds, bounds[1:], strict=False)
    ]
    out[0].num_cached_tokens = NUM_CACHED  # the first token comes with the prefill's counts
    out[-1].finish_reason = finish_reason
    return out


def feed(state: RequestState, all_deltas: list[TokenDelta]) -> tuple[bytes, list[StepOutput]]:
    outputs = [state.add(d) for d in all_deltas]
    return b"".join(o.data for o in outputs), outputs


def sse_events(data: bytes) -> list[tuple[str, dict[str, Any]]]:
    """(event name, payload) of each `event: ...\\ndata: ...\\n\\n` frame, checking the framing."""
    assert data.endswith(b"\n\n")
    events = []
    for frame in data[:-2].split(b"\n\n"):
        event_line, data_line = frame.decode().split("\n")
        assert event_line.startswith("event: ") and data_line.startswith("data: ")
        name, payload = event_line[len("event: ") :], json.loads(data_line[len("data: ") :])
        assert payload["type"] == name
        events.append((name, payload))
    return events


def sdk_client(data: bytes, content_type: str) -> anthropic.Anthropic:
    """The official client, answered with our bytes as if by a server."""

    def handler(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, content=data, headers={"content-type": content_type})

    return anthropic.Anthropic(
        api_key="test",
        base_url="http://postproc.test",
        http_client=httpx2.Client(transport=httpx2.MockTransport(handler)),
        max_retries=0,
    )


def sdk_create(data: bytes) -> Message:
    client = sdk_client(data, "application/json")
    messages: Any = [{"role": "user", "content": PROMPT}]
    return client.messages.create(model=MODEL, max_tokens=64, messages=messages)


def sdk_stream(data: bytes) -> tuple[list[str], Message]:
    """The text deltas and the final Message, as the SDK's stream helper accumulates them."""
    client = sdk_client(data, "text/event-stream")
    messages: Any = [{"role": "user", "content": PROMPT}]
    with client.messages.stream(model=MODEL, max_tokens=64, messages=messages) as stream:
        texts = list(stream.text_stream)
        return texts, stream.get_final_message()


def num_prompt_tokens(tokenizer: Tokenizer) -> int:
    return len(tokenizer.encode(PROMPT))


# --- non-streaming --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("case", "stop_reason", "stop_sequence"),
    [("eos", "end_turn", None), ("length", "max_tokens", None), ("stop", "stop_sequence", "###")],
)
def test_message_body_parses_with_the_sdk(
    tokenizer: Tokenizer, case: str, stop_reason: str, stop_sequence: str | None
) -> None:
    token_ids = tokenizer.encode(OUTPUT)
    if case == "eos":
        token_ids.append(tokenizer.eos_token_id)
    finish = {"eos": "stop", "length": "length", "stop": None}[case]
    state = make_state(tokenizer, stream=False, stop=["###"] if case == "stop" else [])
    data, outputs = feed(state, deltas(token_ids, finish_reason=finish))
    end = next(o for o in outputs if o.done)
    assert data == end.data  # one body, when the message ends
    assert end.abort_upstream == (case == "stop")  # the engine was still decoding

    body = Message.model_validate_json(data)
    assert sdk_create(data) == body
    assert body.id == MESSAGE_ID and body.type == "message" and body.role == "assistant"
    assert body.model == MODEL
    text = OUTPUT[: OUTPUT.index("###")] if case == "stop" else OUTPUT
    assert [(b.type, b.text) for b in body.content] == [("text", text)]  # type: ignore[union-attr]
    assert body.stop_reason == stop_reason and body.stop_sequence == stop_sequence
    assert body.usage.input_tokens == num_prompt_tokens(tokenizer) - NUM_CACHED
    assert body.usage.cache_read_input_tokens == NUM_CACHED
    num_consumed = len(tokenizer.encode(text + (stop_sequence or "")))
    assert body.usage.output_tokens == (len(token_ids) if case != "stop" else num_consumed)


def test_message_body_keeps_one_text_block_when_nothing_was_generated(
    tokenizer: Tokenizer,
) -> None:
    state = make_state(tokenizer, stream=False)
    data, outputs = feed(state, deltas([tokenizer.eos_token_id], finish_reason="stop"))
    body = Message.model_validate_json(data)
    assert [(b.type, b.text) for b in body.content] == [("text", "")]  # type: ignore[union-attr]
    assert body.stop_reason == "end_turn" and body.usage.output_tokens == 1
    assert outputs[-1].done and not outputs[-1].abort_upstream


# --- streaming ------------------------------------------------------------------------------------


def test_stream_events_come_in_order_and_validate_with_the_sdk_types(
    tokenizer: Tokenizer,
) -> None:
    token_ids = tokenizer.encode(OUTPUT)
    data, outputs = feed(
        make_state(tokenizer, stream=True), deltas(token_ids, finish_reason="length")
    )
    assert [o.done for o in outputs] == [False] * (len(outputs) - 1) + [True]
    assert b"[DONE]" not in data

    events = sse_events(data)
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    parsed = [EVENTS.validate_python(payload) for name, payload in events if name != "ping"]

    start = parsed[0]
    assert start.type == "message_start"
    assert start.message.id == MESSAGE_ID and start.message.model == MODEL
    assert start.message.content == [] and start.message.stop_reason is None
    assert start.message.usage.input_tokens == num_prompt_tokens(tokenizer) - NUM_CACHED
    assert start.message.usage.cache_read_input_tokens == NUM_CACHED
    block = parsed[1]
    assert block.type == "content_block_start" and block.index == 0
    assert block.content_block.type == "text" and block.content_block.text == ""
    text_deltas = [e for e in parsed if e.type == "content_block_delta"]
    assert all(e.index == 0 and e.delta.type == "text_delta" for e in text_deltas)
    assert "".join(e.delta.text for e in text_deltas) == OUTPUT  # type: ignore[union-attr]
    message_delta = parsed[-2]
    assert message_delta.type == "message_delta"
    assert message_delta.delta.stop_reason == "max_tokens"
    assert message_delta.delta.stop_sequence is None
    assert message_delta.usage.output_tokens == len(token_ids)


def test_sdk_stream_helper_accumulates_the_same_message_as_the_body(tokenizer: Tokenizer) -> None:
    token_ids = [*tokenizer.encode(OUTPUT), tokenizer.eos_token_id]
    streamed, _ = feed(make_state(tokenizer, stream=True), deltas(token_ids, finish_reason="stop"))
    texts, final = sdk_stream(streamed)
    assert "".join(texts) == OUTPUT
    whole, _ = feed(make_state(tokenizer, stream=False), deltas(token_ids, finish_reason="stop"))
    assert final.model_dump() == Message.model_validate_json(whole).model_dump()
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == len(token_ids)


def test_multi_byte_characters_split_across_tokens_never_show_half(tokenizer: Tokenizer) -> None:
    text = "你好 🎉"
    token_ids = tokenizer.encode(text)
    assert all(tokenizer.decode([t]) == "\ufffd" for t in tokenizer.encode("🎉"))  # 4 byte tokens
    for cuts in ([], None, [1, 2, 5, 8]):  # one delta, one per token, pieces cutting characters
        data, _ = feed(
            make_state(tokenizer, stream=True), deltas(token_ids, finish_reason="length", cuts=cuts)
        )
        shown = [p["delta"]["text"] for n, p in sse_events(data) if n == "content_block_delta"]
        assert "".join(shown) == text and all("\ufffd" not in s for s in shown)
        assert "".join(sdk_stream(data)[0]) == text


def test_stop_string_split_at_every_token_boundary(tokenizer: Tokenizer) -> None:
    token_ids = tokenizer.encode(OUTPUT)
    expected = OUTPUT[: OUTPUT.index("###")]
    for cut in range(1, len(token_ids)):
        state = make_state(tokenizer, stream=True, stop=["###END"])
        data, outputs = feed(state, deltas(token_ids, finish_reason=None, cuts=[cut]))
        assert [o.abort_upstream for o in outputs].count(True) == 1
        assert next(o for o in outputs if o.done).abort_upstream
        shown = ""
        for name, payload in sse_events(data):
            if name == "content_block_delta":
                shown += payload["delta"]["text"]
                assert expected.startswith(shown)  # no part of "###END" was ever sent
        texts, final = sdk_stream(data)
        assert "".join(texts) == shown == expected
        assert final.stop_reason == "stop_sequence" and final.stop_sequence == "###END"


def test_abort_ends_the_stream_with_end_turn(tokenizer: Tokenizer) -> None:
    state = make_state(tokenizer, stream=True)
    first = state.add(deltas(tokenizer.encode("partial"), finish_reason=None, cuts=[])[0])
    assert not first.done
    end = state.add(TokenDelta(request_id=MESSAGE_ID, index=0, token_ids=[], finish_reason="abort"))
    assert end.done and not end.abort_upstream
    names = [name for name, _ in sse_events(first.data + end.data)]
    assert names.count("message_start") == 1 and names[-1] == "message_stop"
    texts, final = sdk_stream(first.data + end.data)
    assert "".join(texts) == "partial" and final.stop_reason == "end_turn"


# --- thinking and tool_use blocks -----------------------------------------------------------------

PARSERS = ParserState(reasoning_parser="qwen3", thinking=True, tool_parser="hermes")
THOUGHT = "the user wants weather"
CALLS = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": "cet"}}\n</tool_call>'
)
PARSED_OUTPUT = f"{THOUGHT}</think>\n\nLet me look.{CALLS}"


def test_thinking_text_and_tool_calls_become_blocks_in_output_order(tokenizer: Tokenizer) -> None:
    token_ids = [*tokenizer.encode(PARSED_OUTPUT), tokenizer.eos_token_id]
    whole, _ = feed(
        make_state(tokenizer, stream=False, parser_state=PARSERS),
        deltas(token_ids, finish_reason="stop"),
    )
    body = Message.model_validate_json(whole)
    assert [b.type for b in body.content] == ["thinking", "text", "tool_use", "tool_use"]
    thinking, text, weather, time_call = body.content
    assert thinking.thinking == THOUGHT and thinking.signature == ""  # type: ignore[union-attr]
    assert text.text == "Let me look."  # type: ignore[union-attr]
    assert (weather.name, weather.input) == ("get_weather", {"city": "Paris"})  # type: ignore[union-attr]
    assert (time_call.name, time_call.input) == ("get_time", {"zone": "cet"})  # type: ignore[union-attr]
    assert weather.id != time_call.id  # type: ignore[union-attr]
    assert body.stop_reason == "tool_use"

    for cuts in (None, [3, 9, 20]):  # a delta per token, and pieces cutting markers and JSON
        streamed, _ = feed(
            make_state(tokenizer, stream=True, parser_state=PARSERS),
            deltas(token_ids, finish_reason="stop", cuts=cuts),
        )
        names = [n for n, _ in sse_events(streamed)]
        assert names.count("content_block_start") == names.count("content_block_stop") == 4
        texts, final = sdk_stream(streamed)
        assert "".join(texts) == "Let me look."
        expected = body.model_dump()
        for block, got in zip(expected["content"], final.model_dump()["content"], strict=True):
            if block["type"] == "tool_use":
                block["id"] = got["id"]  # each run makes its own call ids
        assert final.model_dump() == expected


def test_a_tool_call_cut_by_max_tokens_keeps_its_block_with_empty_input(
    tokenizer: Tokenizer,
) -> None:
    cut = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    state = make_state(tokenizer, stream=False, parser_state=ParserState(tool_parser="hermes"))
    whole, _ = feed(state, deltas(tokenizer.encode(cut), finish_reason="length"))
    body = Message.model_validate_json(whole)
    assert [(b.type, b.input) for b in body.content] == [("tool_use", {})]  # type: ignore[union-attr]
    assert body.stop_reason == "max_tokens"
