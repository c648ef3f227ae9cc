"""Reasoning and tool-call parsers: every split of the text gives the same result as the whole.

Parser outputs are checked against the scripted calls (the streamed arguments must `json.loads` to
the call's arguments), and the formatter's bytes with the `openai` SDK's own types and its own
stream accumulator.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from common.parser_choice import (
    REASONING_PARSER_FOR_MODEL_TYPE,
    REASONING_PARSER_NAMES,
    TOOL_PARSER_FOR_MODEL_TYPE,
    TOOL_PARSER_NAMES,
    ParserState,
    tool_parser_for,
)
from common.protocol import GenerateRequest, OutputOptions, TokenDelta, encode_token_ids
from common.sampling_params import SamplingParams
from common.thinking import resolve_prefilled_thinking
from common.tokenizer import Tokenizer, load_tokenizer
from frontend import chat
from frontend.chat_template import RenderedPrompt
from frontend.structured import ToolPlan
from postproc_worker.detokenizer import IncrementalDetokenizer
from postproc_worker.formatter import RequestState
from postproc_worker.parsers import (
    REASONING_PARSERS,
    TOOL_PARSERS,
    ChoiceParsers,
    ReasoningParser,
    special_texts,
)
from postproc_worker.parsers.tools import ToolCallArguments, ToolCallStart, ToolEvent

CALL_ID = re.compile(r"call_[0-9a-f]{24}")
WEATHER = {"city": "東京", "note": 'braces } { and "quotes" in a string 🎉', "days": [1, {"n": 2}]}
Call = tuple[str, Any]  # (name, arguments)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path: Path) -> Tokenizer:
    return load_tokenizer(tiny_model_path)


def splits(text: str) -> Iterator[list[str]]:
    """The whole text, the text cut in two at every character boundary, and one char at a time."""
    yield [text]
    for cut in range(1, len(text)):
        yield [text[:cut], text[cut:]]
    yield list(text)


def token_pieces(tokenizer: Tokenizer, text: str) -> list[str]:
    """The deltas the postproc worker would see: one token at a time, whole characters only."""
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    pieces = [detokenizer.add([t]) for t in tokenizer.encode(text)]
    return [*pieces, detokenizer.flush()]


def collect(events: list[ToolEvent]) -> tuple[str, list[tuple[str, str, str]]]:
    """Content, and (id, name, arguments text) per call, checking the events' order."""
    content, calls = "", []
    for event in events:
        if isinstance(event, str):
            content += event
        elif isinstance(event, ToolCallStart):
            assert event.index == len(calls) and CALL_ID.fullmatch(event.id)
            calls.append([event.id, event.name, ""])
        else:
            assert isinstance(event, ToolCallArguments) and event.index == len(calls) - 1
            calls[-1][2] += event.text
    return content, [(i, n, a) for i, n, a in calls]


def run_tools(name: str, pieces: list[str], in_tool_call: bool = False) -> list[ToolEvent]:
    parser = TOOL_PARSERS[name](in_tool_call=in_tool_call)
    events = [e for piece in pieces for e in parser.feed(piece)]
    return events + parser.finish()


def hermes_call(name: str, arguments: Any) -> str:
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def deepseek_call(name: str, arguments: Any) -> str:
    args = json.dumps(arguments, ensure_ascii=False)
    return (
        f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{args}\n```"
        "<｜tool▁call▁end｜>"
    )


TOOL_CASES: list[tuple[str, str, str, list[Call]]] = [
    (
        "hermes",
        "Let me look: 天気 ☀.\n\n"
        + hermes_call("get_weather", WEATHER)
        + "\n"
        + hermes_call("get_time", {})
        + "\nDone 👍",
        "Let me look: 天気 ☀.Done 👍",
        [("get_weather", WEATHER), ("get_time", {})],
    ),
    ("qwen3", hermes_call("f", {"x": [1, 2]}), "", [("f", {"x": [1, 2]})]),
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": '
        + json.dumps(WEATHER)
        + '}; {"type": "function", "name": "g", "parameters": {}}',
        "",
        [("get_weather", WEATHER), ("g", {})],
    ),
    (
        "llama3_json",
        'Sure. <|python_tag|>{"name": "f", "arguments": {"a": "}"}}',
        "Sure.",
        [("f", {"a": "}"})],
    ),
    ("llama3_json", '{"answer": 42, "name": "x"}', '{"answer": 42, "name": "x"}', []),
    (
        "mistral",
        "Checking 東京. [TOOL_CALLS] ["
        + json.dumps({"name": "get_weather", "arguments": WEATHER})
        + ', {"arguments": "{\\"a\\": 1}", "name": "g"}]',
        "Checking 東京.",
        [("get_weather", WEATHER), ("g", {"a": 1})],
    ),
    (
        "deepseek_v3",
        "I'll check 🌧\n<｜tool▁calls▁begin｜>"
        + deepseek_call("get_weather", WEATHER)
        + "\n"
        + deepseek_call("get_time", {})
        + "<｜tool▁calls▁end｜>\nThat is all.",
        "I'll check 🌧That is all.",
        [("get_weather", WEATHER), ("get_time", {})],
    ),
]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), TOOL_CASES)
def test_tool_parser_gives_the_same_calls_however_the_text_is_split(
    parser: str, text: str, content: str, calls: list[Call]
) -> None:
    whole_content, whole_calls = collect(run_tools(parser, [text]))
    assert whole_content == content
    assert [(name, json.loads(args)) for _, name, args in whole_calls] == calls
    for pieces in splits(text):
        got_content, got_calls = collect(run_tools(parser, pieces))
        assert got_content == content, pieces
        assert [(n, a) for _, n, a in got_calls] == [(n, a) for _, n, a in whole_calls], pieces


@pytest.mark.parametrize(("parser", "text", "content", "calls"), TOOL_CASES)
def test_tool_parser_on_tiny_tokenizer_token_boundaries(
    tokenizer: Tokenizer, parser: str, text: str, content: str, calls: list[Call]
) -> None:
    pieces = token_pieces(tokenizer, text)
    assert "".join(pieces) == text
    got_content, got_calls = collect(run_tools(parser, pieces))
    assert got_content == content
    assert [(name, json.loads(args)) for _, name, args in got_calls] == calls


def test_content_without_calls_passes_through_unchanged() -> None:
    text = "Plain answer, 中文 and 🎉, ending in whitespace\n\n"
    for name in TOOL_PARSERS:
        for pieces in splits(text):
            assert collect(run_tools(name, pieces)) == (text, [])


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        ("hermes", '{"name": "f", "arguments": {"q": "东"}}\n</tool_call>'),
        ("mistral", '[{"name": "f", "arguments": {"q": "东"}}]'),
        ("deepseek_v3", deepseek_call("f", {"q": "东"}) + "<｜tool▁calls▁end｜>"),
        ("llama3_json", '{"name": "f", "parameters": {"q": "东"}}'),
    ],
)
def test_forced_call_output_starts_inside_the_call(parser: str, text: str) -> None:
    for pieces in splits(text):
        content, calls = collect(run_tools(parser, pieces, in_tool_call=True))
        assert content == "" and [(n, json.loads(a)) for _, n, a in calls] == [("f", {"q": "东"})]


def test_truncated_call_keeps_its_started_arguments() -> None:
    text = 'Hi <tool_call>\n{"name": "f", "arguments": {"q": "东京'
    for pieces in splits(text):
        content, calls = collect(run_tools("hermes", pieces))
        assert content == "Hi" and [(n, a) for _, n, a in calls] == [("f", '{"q": "东京')]


def test_call_that_never_started_becomes_content_without_markers() -> None:
    for text, content in [
        ('Hi <tool_call>\n{"name": "f"', 'Hi \n{"name": "f"'),  # cut before the arguments
        ("Hi <tool_call>not json</tool_call> bye", "Hi not json bye"),
        ("stray </tool_call> end marker", "stray  end marker"),
    ]:
        for pieces in splits(text):
            assert collect(run_tools("hermes", pieces)) == (content, []), pieces


def test_hermes_call_without_arguments_has_empty_object() -> None:
    content, calls = collect(run_tools("hermes", ['<tool_call>\n{"name": "now"}\n</tool_call>']))
    assert content == "" and [(n, a) for _, n, a in calls] == [("now", "{}")]


# --- reasoning ------------------------------------------------------------------------------------

REASONING_CASES = [
    (
        "qwen3",
        None,
        "<think>\nLet me think 🤔\n</think>\n\nHello 世界",
        "\nLet me think 🤔\n",
        "Hello 世界",
    ),
    ("qwen3", None, "  <think>a</think>b", "a", "b"),
    ("qwen3", None, "No thinking, <think> later is text", "", "No thinking, <think> later is text"),
    ("qwen3", True, "still thinking</think>answer", "still thinking", "answer"),
    ("qwen3", False, "<think>x</think>y", "", "<think>x</think>y"),
    ("deepseek-r1", None, "plan 一</think>\nanswer", "plan 一", "answer"),
    ("deepseek-r1", None, "<think>plan</think>answer", "plan", "answer"),
    ("deepseek-r1", None, "cut off while thinking </thi", "cut off while thinking </thi", ""),
    ("deepseek-r1", False, "answer only", "", "answer only"),
]


@pytest.mark.parametrize(("fmt", "thinking", "text", "reasoning", "content"), REASONING_CASES)
def test_reasoning_split_at_every_character_boundary(
    fmt: str, thinking: bool | None, text: str, reasoning: str, content: str
) -> None:
    for pieces in splits(text):
        parser = ReasoningParser(REASONING_PARSERS[fmt], thinking)
        outputs = [parser.feed(p) for p in pieces] + [parser.finish()]
        assert "".join(r for r, _ in outputs) == reasoning, pieces
        assert "".join(c for _, c in outputs) == content, pieces


def test_reasoning_on_tiny_tokenizer_token_boundaries(tokenizer: Tokenizer) -> None:
    text = "<think>\n考虑一下 🤔</think>\n\nAnswer: 42"
    parser = ReasoningParser(REASONING_PARSERS["qwen3"], None)
    outputs = [parser.feed(p) for p in token_pieces(tokenizer, text)] + [parser.finish()]
    assert "".join(r for r, _ in outputs) == "\n考虑一下 🤔"
    assert "".join(c for _, c in outputs) == "Answer: 42"


@pytest.mark.parametrize(
    ("template_text", "expected"),
    [
        ("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n", True),
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),  # Qwen3 enable_thinking=False
        ("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", None),
        ("<think>" + "x" * 80, None),  # an old marker far from the end says nothing
    ],
)
def test_resolve_prefilled_thinking(template_text: str, expected: bool | None) -> None:
    assert resolve_prefilled_thinking(template_text) is expected


# --- parser_state, registry and the whole pipeline ------------------------------------------------


def test_parser_state_round_trips_and_rejects_bad_values() -> None:
    state = ParserState(reasoning_parser="qwen3", thinking=False, tool_parser="hermes")
    assert msgspec.to_builtins(state) == {
        "reasoning_parser": "qwen3",
        "thinking": False,
        "tool_parser": "hermes",
    }
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(state), type=ParserState) == state
    assert not msgspec.convert({"thinking": None}, ParserState).active
    for bad in [
        {"tool_parser": "nope"},
        {"reasoning_parser": "nope"},
        {"in_tool_call": True},
        {"thinking": "yes"},
        {"tool_parsr": "hermes"},
    ]:
        with pytest.raises(msgspec.ValidationError):
            msgspec.convert(bad, ParserState)


def test_parser_state_rejects_an_unknown_parser_when_built() -> None:
    for bad in [{"tool_parser": "nope"}, {"reasoning_parser": "nope"}, {"in_tool_call": True}]:
        with pytest.raises(ValueError):
            ParserState(**bad)  # type: ignore[arg-type]


def test_the_parser_registries_hold_exactly_the_names_on_the_wire() -> None:
    assert set(REASONING_PARSERS) == REASONING_PARSER_NAMES
    assert set(TOOL_PARSERS) == TOOL_PARSER_NAMES


def test_the_frontends_parser_choice_names_parsers_that_exist() -> None:
    for model_type, name in TOOL_PARSER_FOR_MODEL_TYPE.items():
        assert name in TOOL_PARSERS, model_type
    for model_type, name in REASONING_PARSER_FOR_MODEL_TYPE.items():
        assert name in REASONING_PARSERS, model_type
    assert tool_parser_for("gpt2") in TOOL_PARSERS  # unknown model types fall back to hermes


def test_pipeline_drops_special_tokens_but_not_markers(tokenizer: Tokenizer) -> None:
    text = "<think>a<|im_start|>b</think>c<|endoftext|>d" + hermes_call("f", {"k": "<|im_end|>"})
    state = ParserState(reasoning_parser="qwen3", tool_parser="hermes")
    for pieces in splits(text):
        parsers = ChoiceParsers(state, special_texts(tokenizer))
        parsed = [parsers.feed(p) for p in pieces] + [parsers.feed("", final=True)]
        assert "".join(p.reasoning for p in parsed) == "ab"
        content, calls = collect([e for p in parsed for e in p.events])
        assert content == "cd"
        assert [(n, json.loads(a)) for _, n, a in calls] == [("f", {"k": ""})]  # dropped there too


# --- formatter ------------------------------------------------------------------------------------

OUTPUT = (
    "<think>\nThe user wants the weather in 東京 🤔.\n</think>\n\nLet me check."
    + hermes_call("get_weather", WEATHER)
    + hermes_call("get_time", {"tz": "Asia/Tokyo"})
)
PARSED: dict[str, Any] = {
    "reasoning_content": "\nThe user wants the weather in 東京 🤔.\n",
    "content": "Let me check.",
    "calls": [("get_weather", WEATHER), ("get_time", {"tz": "Asia/Tokyo"})],
}
PARSER_STATE = ParserState(reasoning_parser="qwen3", tool_parser="hermes")


def make_state(
    tokenizer: Tokenizer,
    *,
    stream: bool,
    parser_state: ParserState | None,
    kind: str = "chat",
    logprobs: int | None = None,
) -> RequestState:
    request = GenerateRequest(
        request_id="chatcmpl-abc123",
        prompt_token_ids_b64=encode_token_ids(tokenizer.encode("<|im_start|>assistant\n")),
        sampling=SamplingParams(logprobs=logprobs, max_tokens=256),
        output=OutputOptions(
            kind=kind,  # type: ignore[arg-type]
            model="tiny",
            created=1_700_000_000,
            stream=stream,
            parser_state=parser_state,
        ),
        reply_to="tcp://127.0.0.1:5999",
    )
    return RequestState(request.postproc_start(), tokenizer)


def run(state: RequestState, token_ids: list[int], cut: int | None, finish: str) -> bytes:
    """One delta per token, or two deltas split at `cut`; the last carries `finish`."""
    bounds = [0, cut, len(token_ids)] if cut is not None else range(len(token_ids) + 1)
    pieces = [token_ids[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    data = b""
    for k, ids in enumerate(pieces):
        lps = [-0.5] * len(ids)
        last = k == len(pieces) - 1
        delta = TokenDelta(
            request_id="r", index=0, token_ids=ids, logprobs=lps, top_logprobs=[[]] * len(ids)
        )
        delta.finish_reason = finish if last else None
        data += state.add(delta).data
    return data


def stream_chunks(data: bytes) -> list[ChatCompletionChunk]:
    frames = data.decode().split("\n\n")
    assert frames[-2:] == ["data: [DONE]", ""]
    return [ChatCompletionChunk.model_validate_json(f[len("data: ") :]) for f in frames[:-2]]


def check_message(message: Any) -> None:
    assert message.reasoning_content == PARSED["reasoning_content"]
    assert message.content == PARSED["content"]
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]
    assert calls == PARSED["calls"]
    assert all(CALL_ID.fullmatch(c.id) and c.type == "function" for c in message.tool_calls)


def test_chat_body_has_reasoning_content_and_tool_calls(tokenizer: Tokenizer) -> None:
    token_ids = [*tokenizer.encode(OUTPUT), tokenizer.eos_token_id]
    state = make_state(tokenizer, stream=False, parser_state=PARSER_STATE)
    body = ChatCompletion.model_validate_json(run(state, token_ids, None, "stop"))
    assert body.choices[0].finish_reason == "tool_calls"
    check_message(body.choices[0].message)


def test_chat_stream_parses_at_every_token_cut_with_the_sdk_accumulator(
    tokenizer: Tokenizer,
) -> None:
    token_ids = [*tokenizer.encode(OUTPUT), tokenizer.eos_token_id]
    for cut in [None, *range(1, len(token_ids))]:
        state = make_state(tokenizer, stream=True, parser_state=PARSER_STATE, logprobs=0)
        chunks = stream_chunks(run(state, token_ids, cut, "stop"))
        accumulator = ChatCompletionStreamState()
        for chunk in chunks:
            accumulator.handle_chunk(chunk)
        final = accumulator.get_final_completion()
        assert final.choices[0].finish_reason == "tool_calls"
        check_message(final.choices[0].message)
        entries = [e for ch in chunks for c in ch.choices if c.logprobs for e in c.logprobs.content]
        assert len(entries) == len(token_ids)  # held text delays logprobs, never drops them
        fragments = [t for ch in chunks for c in ch.choices for t in c.delta.tool_calls or []]
        firsts = {f.index: f for f in reversed(fragments)}
        assert all(f.id and f.type == "function" and f.function.name for f in firsts.values())
        rest = [f for f in fragments if f is not firsts[f.index]]
        assert all(f.id is None and f.type is None and f.function.name is None for f in rest)


def test_tool_calls_finish_reason_only_when_stopped(tokenizer: Tokenizer) -> None:
    token_ids = tokenizer.encode(OUTPUT.removesuffix("</tool_call>"))  # no end marker
    state = make_state(tokenizer, stream=False, parser_state=PARSER_STATE)
    body = ChatCompletion.model_validate_json(run(state, token_ids, None, "length"))
    assert body.choices[0].finish_reason == "length"
    assert [c.function.name for c in body.choices[0].message.tool_calls or []] == [
        "get_weather",
        "get_time",
    ]


@pytest.mark.parametrize("stream", [True, False])
def test_inactive_parser_state_leaves_the_bytes_unchanged(
    tokenizer: Tokenizer, stream: bool
) -> None:
    token_ids = [*tokenizer.encode(OUTPUT), tokenizer.eos_token_id]
    plain = run(make_state(tokenizer, stream=stream, parser_state=None), token_ids, None, "stop")
    for kind, parser_state in [("chat", ParserState(thinking=True)), ("completion", PARSER_STATE)]:
        state = make_state(tokenizer, stream=stream, parser_state=None, kind=kind)
        expected = run(state, token_ids, None, "stop")
        state = make_state(tokenizer, stream=stream, parser_state=parser_state, kind=kind)
        assert run(state, token_ids, None, "stop") == expected
    assert b"reasoning_content" not in plain and b"tool_calls" not in plain


def test_the_frontend_sends_a_parser_state_only_when_a_parser_applies() -> None:
    """frontend/chat.py builds the typed state itself: None when no parser would run."""
    thinking = RenderedPrompt("<|im_start|>assistant\n<think>\n", "")
    llama: Any = SimpleNamespace(model_type="llama", tool_parser="llama3_json")
    qwen3: Any = SimpleNamespace(model_type="qwen3", tool_parser="hermes")
    forced_call = ToolPlan(parse_tools=True, in_tool_call=True)
    assert chat.parser_state(llama, thinking, ToolPlan()) is None
    assert chat.parser_state(llama, thinking, forced_call) == ParserState(
        tool_parser="llama3_json", in_tool_call=True
    )
    assert chat.parser_state(qwen3, thinking, ToolPlan()) == ParserState(
        reasoning_parser="qwen3", thinking=True
    )
    assert chat.parser_state(qwen3, thinking, ToolPlan(parse_tools=True)) == ParserState(
        reasoning_parser="qwen3", thinking=True, tool_parser="hermes"
    )
