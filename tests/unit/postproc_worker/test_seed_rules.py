"""The postproc side of the seed's rules and the client-library findings (issue 34):
continuous_usage_stats, a tool-call turn's first chunk (`content: null`, as OpenAI streams it),
and a choice's repeated tool calls dropped. Bytes checked with the `openai` SDK's own types."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from common.parser_choice import ParserState
from common.protocol import GenerateRequest, OutputOptions, TokenDelta, encode_token_ids
from common.sampling_params import SamplingParams
from common.tokenizer import Tokenizer, load_tokenizer
from postproc_worker.formatter import RequestState
from tests.unit.postproc_worker.test_formatter import PROMPT, sdk_stream, sse_payloads

HERMES = ParserState(tool_parser="hermes")


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path: Path) -> Tokenizer:
    return load_tokenizer(tiny_model_path)


def run(tokenizer: Tokenizer, text: str, stream: bool = True, **output: Any) -> bytes:
    """`text` as the model's output, one token a delta, through a fresh RequestState."""
    options = OutputOptions(model="tiny", created=1, stream=stream, **output)
    request = GenerateRequest(
        request_id="chatcmpl-1" if options.kind == "chat" else "cmpl-1",
        prompt_token_ids_b64=encode_token_ids(tokenizer.encode(PROMPT)),
        sampling=SamplingParams(max_tokens=200),
        output=options,
        reply_to="tcp://127.0.0.1:5999",
    )
    state = RequestState(request.postproc_start(), tokenizer)
    ids = tokenizer.encode(text)
    data = b""
    for k, token_id in enumerate(ids):
        last = k == len(ids) - 1
        delta = TokenDelta(request_id="r", index=0, token_ids=[token_id],
                           finish_reason="stop" if last else None, num_prompt_tokens=0)  # fmt: skip
        data += state.add(delta).data
    return data


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_continuous_usage_stats_puts_the_usage_so_far_on_every_chunk(
    tokenizer: Tokenizer, kind: str
) -> None:
    text = "one two three four"
    data = run(tokenizer, text, kind=kind, continuous_usage=True)
    chunks = sdk_stream(data, kind)
    num_prompt = len(tokenizer.encode(PROMPT))
    used = [c.usage.completion_tokens for c in chunks]
    assert all(c.usage.prompt_tokens == num_prompt for c in chunks)
    assert all(c.usage.total_tokens == num_prompt + c.usage.completion_tokens for c in chunks)
    assert used == sorted(used) and used[-1] == len(tokenizer.encode(text))
    assert all(c.choices for c in chunks)  # no usage-only chunk unless include_usage
    with_ending = sdk_stream(run(tokenizer, text, kind=kind, continuous_usage=True,
                                 include_usage=True), kind)  # fmt: skip
    assert with_ending[-1].choices == [] and with_ending[-1].usage.completion_tokens == used[-1]


def call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def test_a_tool_call_turn_opens_with_null_content_and_the_call(tokenizer: Tokenizer) -> None:
    data = run(tokenizer, call("get_weather", '{"city": "Oslo"}'), kind="chat",
               parser_state=HERMES)  # fmt: skip
    payloads = sse_payloads(data)
    first = json.loads(payloads[0])["choices"][0]["delta"]
    assert first["role"] == "assistant" and first["content"] is None  # OpenAI's: null, not ""
    assert first["tool_calls"][0]["function"]["name"] == "get_weather"
    chunks = [ChatCompletionChunk.model_validate_json(p) for p in payloads]
    assert all(c.choices[0].delta.role is None for c in chunks[1:])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # a text turn still opens with the role alone and content ""
    text = json.loads(sse_payloads(run(tokenizer, "Sunny.", kind="chat",
                                       parser_state=HERMES))[0])  # fmt: skip
    assert text["choices"][0]["delta"] == {"role": "assistant", "content": ""}


def tool_calls(tokenizer: Tokenizer, text: str, stream: bool) -> list[tuple[int, str, Any]]:
    data = run(tokenizer, text, stream=stream, kind="chat", parser_state=HERMES)
    if not stream:
        message = ChatCompletion.model_validate_json(data).choices[0].message
        calls = [
            (i, c.function.name, c.function.arguments) for i, c in enumerate(message.tool_calls)
        ]
        return [(i, n, json.loads(a)) for i, n, a in calls]
    merged: dict[int, list[str]] = {}
    for chunk in sdk_stream(data, "chat"):
        for delta in chunk.choices[0].delta.tool_calls or []:
            merged.setdefault(delta.index, ["", ""])
            merged[delta.index][0] += delta.function.name or ""
            merged[delta.index][1] += delta.function.arguments or ""
    return [(i, name, json.loads(arguments)) for i, (name, arguments) in sorted(merged.items())]


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_that_repeats_an_earlier_one_is_dropped(tokenizer: Tokenizer, stream: bool) -> None:
    text = "\n".join([call("f", '{"a": 1}'), call("f", '{"a":1}'), call("f", '{"a": 2}'),
                      call("g", '{"a": 1}'), call("f", '{"a": 2}')])  # fmt: skip
    assert tool_calls(tokenizer, text, stream) == [(0, "f", {"a": 1}), (1, "f", {"a": 2}),
                                                   (2, "g", {"a": 1})]  # fmt: skip
