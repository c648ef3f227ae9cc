"""The harmony parser (postproc_worker/parsers/harmony.py): channels to reasoning, content and
tool calls; the same result however the output is split, cut or malformed; no marker ever shown.
Through the whole postproc pipeline with the harmony tokenizer, the official SDK's stream
accumulator reads the chunks as a complete message."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response

from common.harmony import MARKERS
from common.parser_choice import ParserState
from common.protocol import GenerateRequest, OutputOptions, TokenDelta, encode_token_ids
from common.responses_schema import ResponseSettings
from common.sampling_params import SamplingParams
from common.tokenizer import Tokenizer, load_tokenizer
from postproc_worker.formatter import RequestState
from postproc_worker.parsers import ChoiceParsers, special_texts
from postproc_worker.parsers.harmony import HarmonyParser
from postproc_worker.parsers.tools import ToolCallArguments, ToolCallStart
from tests.unit.harmony_model import write_harmony_model_dir
from tools.tiny_arch.harmony import CALL_ID, RETURN_ID

HARMONY = ParserState(reasoning_parser="harmony", tool_parser="harmony")
NO_TOOLS = ParserState(reasoning_parser="harmony")
CALL_HEADER = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"


def parse(pieces: list[str], state: ParserState = HARMONY) -> tuple[str, str, list[list[str]]]:
    """(reasoning, content, [[name, arguments], ...]) of the pieces fed in order."""
    parsers = ChoiceParsers(state, frozenset({"<|endoftext|>", "<|startoftext|>"}))
    parsed = [parsers.feed(p) for p in pieces] + [parsers.feed("", final=True)]
    reasoning = "".join(p.reasoning for p in parsed)
    content, calls = "", []
    for event in (e for p in parsed for e in p.events):
        if isinstance(event, str):
            content += event
        elif isinstance(event, ToolCallStart):
            assert event.index == len(calls)
            calls.append([event.name, ""])
        else:
            assert isinstance(event, ToolCallArguments)
            calls[event.index][1] += event.text
    return reasoning, content, calls


CASES: list[tuple[str, tuple[str, str, list[list[str]]]]] = [
    (  # docs/format.md "Example output"
        '<|channel|>analysis<|message|>User asks: "What is 2 + 2?" Simple arithmetic. Provide '
        "answer.<|end|><|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>",
        ('User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.', "2 + 2 = 4.", []),
    ),
    (  # docs/format.md "Receiving tool calls" (the stop token dropped, as the worker drops it)
        "<|channel|>analysis<|message|>Need to use function get_weather.<|end|><|start|>assistant"
        '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"location":'
        '"San Francisco"}',
        (
            "Need to use function get_weather.",
            "",
            [["get_weather", '{"location":"San Francisco"}']],
        ),  # fmt: skip
    ),
    (  # the recipient in the role section, no <|constrain|>, a preamble first
        "<|channel|>analysis<|message|>plan<|end|><|start|>assistant<|channel|>commentary"
        "<|message|>**Action plan**: look it up.<|end|><|start|>assistant to=functions.f"
        '<|channel|>commentary json<|message|>{"a": 1}<|call|>',
        ("plan", "**Action plan**: look it up.", [["f", '{"a": 1}']]),
    ),
    (  # two analysis messages, then the answer: joined with a newline
        "<|channel|>analysis<|message|>one<|end|><|start|>assistant<|channel|>analysis"
        "<|message|>two<|end|><|start|>assistant<|channel|>final<|message|>three",
        ("one\ntwo", "three", []),
    ),
    (
        "<|channel|>analysis<|message|>cut in the middle of thi",
        ("cut in the middle of thi", "", []),
    ),
    ("<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>fin", ("x", "", [])),
    # max_tokens cuts the next message's role: metadata, not content
    ("<|channel|>analysis<|message|>x<|end|><|start|>assistant", ("x", "", [])),
    ("<|channel|>analysis<|message|>x<|end|><|start|>ass", ("x", "", [])),
    ("<|channel|>final<|message|>a<|start|>assist", ("", "a", [])),
    (
        f'<|channel|>analysis<|message|>x<|end|><|start|>assistant{CALL_HEADER}{{"loc',
        ("x", "", [["get_weather", '{"loc']]),
    ),  # fmt: skip
    (f"{CALL_HEADER}<|call|>", ("", "", [["get_weather", "{}"]])),
    ("Hello, no harmony at all.", ("", "Hello, no harmony at all.", [])),
    ("<|channel|>final Hello<|return|>", ("", "final Hello", [])),
    ("<|channel|>final<|message|>a<|channel|>b<|constrain|>c<|message|>d", ("", "abcd", [])),
    ("<|channel|>analysis to=python<|message|>print(1)<|call|>", ("print(1)", "", [])),
    ("<|channel|>banter<|message|>odd channel", ("", "odd channel", [])),
    (
        "<|channel|>final<|message|>a<|start|>assistant<|channel|>final<|message|>b",
        ("", "a\nb", []),
    ),
    ("<|endoftext|><|channel|>final<|message|>x<|endoftext|>y", ("", "xy", [])),
]


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_channels_split_the_same_however_the_text_arrives(
    text: str, expected: tuple[str, str, list[list[str]]]
) -> None:
    assert parse([text]) == expected
    assert parse(list(text)) == expected
    for cut in range(1, len(text)):
        assert parse([text[:cut], text[cut:]]) == expected


def test_calls_are_content_when_no_tools_were_asked_for() -> None:
    text = f'<|channel|>analysis<|message|>x<|end|><|start|>assistant{CALL_HEADER}{{"a":1}}'
    assert parse([text], NO_TOOLS) == ("x", '{"a":1}', [])


WORDS = st.sampled_from(
    ["hi", " ", "\n", "to=functions.f", "to=functions.g", "to=python", "analysis", "final",
     "commentary", "json", '{"a": 1}', "}", "é", "<|"]
)  # fmt: skip
PIECES = st.lists(st.one_of(WORDS, st.sampled_from(MARKERS), st.just("<|endoftext|>")), max_size=30)


@settings(max_examples=400, deadline=None)
@given(pieces=PIECES, seed=st.integers(0, 2**32 - 1), tools=st.booleans())
def test_any_output_streamed_equals_parsed_whole_and_shows_no_marker(
    pieces: list[str], seed: int, tools: bool
) -> None:
    text = "".join(pieces)
    state = HARMONY if tools else NO_TOOLS
    whole = parse([text], state)
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 4))) if text else []
    split = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    assert parse(split, state) == whole
    reasoning, content, calls = whole
    for shown in [reasoning, content, *(a for _, a in calls)]:
        assert not any(m in shown for m in (*MARKERS, "<|endoftext|>"))


def test_the_parser_is_the_registered_harmony_tool_parser() -> None:
    from postproc_worker.parsers import TOOL_PARSERS

    assert TOOL_PARSERS["harmony"] is HarmonyParser


# --- the postproc pipeline, token by token --------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return load_tokenizer(write_harmony_model_dir(tmp_path_factory.mktemp("gpt-oss")))


OUTPUT = (
    "<|channel|>analysis<|message|>User wants the weather in 東京 🤔.<|end|><|start|>assistant"
    + CALL_HEADER
    + '{"location":"東京"}'
)


def make_state(tokenizer: Tokenizer, kind: str, stream: bool) -> RequestState:
    request = GenerateRequest(
        request_id="chatcmpl-abc123",
        prompt_token_ids_b64=encode_token_ids(tokenizer.encode("<|start|>assistant")),
        sampling=SamplingParams(max_tokens=256),
        output=OutputOptions(
            kind=kind,  # type: ignore[arg-type]
            model="tiny-gpt-oss",
            created=1_700_000_000,
            stream=stream,
            parser_state=HARMONY,
            responses=ResponseSettings() if kind == "responses" else None,
        ),
        reply_to="tcp://127.0.0.1:5999",
    )
    return RequestState(request.postproc_start(), tokenizer)


def run(state: RequestState, token_ids: list[int], cut: int | None) -> bytes:
    bounds = [0, cut, len(token_ids)] if cut is not None else range(len(token_ids) + 1)
    data = b""
    pieces = [token_ids[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    for k, ids in enumerate(pieces):
        delta = TokenDelta(request_id="r", index=0, token_ids=ids)
        delta.finish_reason = "stop" if k == len(pieces) - 1 else None
        data += state.add(delta).data
    return data


def test_harmony_markers_are_single_tokens_that_reach_the_parser(tokenizer: Tokenizer) -> None:
    token_ids = [*tokenizer.encode(OUTPUT), CALL_ID]
    assert all(len(tokenizer.encode(m)) == 1 for m in MARKERS)
    assert "<|channel|>" in special_texts(tokenizer)  # special: skipped unless a parser runs
    body = ChatCompletion.model_validate_json(run(make_state(tokenizer, "chat", False), token_ids,
                                                  None))  # fmt: skip
    message = body.choices[0].message
    assert body.choices[0].finish_reason == "tool_calls"
    assert message.reasoning_content == "User wants the weather in 東京 🤔."  # type: ignore[attr-defined]
    assert message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []
            ] == [("get_weather", {"location": "東京"})]  # fmt: skip


def test_chat_stream_at_every_token_cut_reads_as_the_whole(tokenizer: Tokenizer) -> None:
    final = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final"
    for text, eos in [(OUTPUT, CALL_ID), (final + "<|message|>Four. ✓", RETURN_ID)]:
        token_ids = [*tokenizer.encode(text), eos]
        for cut in [None, *range(1, len(token_ids))]:
            data = run(make_state(tokenizer, "chat", True), token_ids, cut).decode()
            frames = [f[len("data: ") :] for f in data.split("\n\n") if f.startswith("data: {")]
            accumulator = ChatCompletionStreamState()
            for frame in frames:
                accumulator.handle_chunk(ChatCompletionChunk.model_validate_json(frame))
            choice = accumulator.get_final_completion().choices[0]
            if eos == CALL_ID:
                assert choice.finish_reason == "tool_calls"
                assert choice.message.tool_calls and choice.message.tool_calls[0].function.name
            else:
                assert (choice.finish_reason, choice.message.content) == ("stop", "Four. ✓")
            assert not any(m in data for m in MARKERS)


def test_responses_items_reasoning_then_the_call(tokenizer: Tokenizer) -> None:
    token_ids = [*tokenizer.encode(OUTPUT), CALL_ID]
    response = Response.model_validate_json(
        run(make_state(tokenizer, "responses", False), token_ids, None)
    )
    kinds: list[Any] = [item.type for item in response.output]
    assert kinds == ["reasoning", "function_call"]
    call = response.output[1]
    assert call.type == "function_call" and json.loads(call.arguments) == {"location": "東京"}
