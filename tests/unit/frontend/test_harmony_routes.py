"""A gpt_oss model on the frontend: the chat, Responses and Messages routes render harmony
(common/harmony.py), ask for the harmony parser, and build their grammars in harmony's
channels. The official SDKs talk to the real app; the cluster's answers are made by the real
postproc formatter from canned harmony token ids, so the SDKs read what a cluster would send."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import llguidance
import msgspec
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from starlette.testclient import TestClient

from common import harmony
from common.config import ClusterConfig, FrontendConfig
from common.guided import check
from common.harmony import SystemSettings
from common.parser_choice import ParserState
from common.protocol import Chunk, GenerateRequest, TokenDelta, decode_token_ids
from frontend.app import build_app
from frontend.model_info import ModelInfo, load_model_info
from postproc_worker.formatter import RequestState
from tests.unit.frontend.conftest import FakeClusterClient
from tests.unit.harmony_model import write_harmony_model_dir
from tools.tiny_arch.harmony import CALL_ID, CHANNEL_ID, END_ID, MESSAGE_ID, RETURN_ID

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Gets the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"location": {"type": "string"}},
            "required": ["location"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
THOUGHT = "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
CALL = (
    '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"location":"Oslo"}'
)
FINAL = "<|channel|>final<|message|>It is sunny in Oslo."


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_harmony_model_dir(tmp_path_factory.mktemp("gpt-oss"))


@pytest.fixture(scope="module")
def model(model_dir: Path) -> ModelInfo:
    return load_model_info(ClusterConfig(model=str(model_dir)))


@pytest.fixture
def fake() -> FakeClusterClient:
    return FakeClusterClient()


@pytest.fixture
def http(model: ModelInfo, fake: FakeClusterClient, tmp_path: Path) -> Iterator[TestClient]:
    config = ClusterConfig(
        model=model.name, frontend=FrontendConfig(responses_store=str(tmp_path / "s.sqlite3"))
    )
    with TestClient(build_app(config, fake, model), raise_server_exceptions=False) as client:
        yield client


@pytest.fixture
def oai(http: TestClient) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http,
                         max_retries=0)  # fmt: skip


def answer_with(fake: FakeClusterClient, model: ModelInfo, output: str, eos: int) -> None:
    """The cluster answers every request with `output`, ended by the stop token `eos`, through
    the real postproc formatter (one delta per token)."""

    def reply(request: GenerateRequest) -> list[Chunk]:
        state = RequestState(request.postproc_start(), model.tokenizer)
        token_ids = [*model.tokenizer.encode(output), eos]
        chunks = []
        for k, token_id in enumerate(token_ids):
            delta = TokenDelta(request_id=request.request_id, index=0, token_ids=[token_id])
            delta.finish_reason = "stop" if k == len(token_ids) - 1 else None
            step = state.add(delta)
            if step.data or step.done:
                chunks.append(Chunk(request_id=request.request_id, data=step.data,
                                    done=step.done))  # fmt: skip
        return chunks

    fake.reply = reply


def prompt_of(model: ModelInfo, request: GenerateRequest) -> str:
    ids = decode_token_ids(request.prompt_token_ids_b64)
    return model.tokenizer.decode(ids, skip_special_tokens=False)


def today(effort: Any = "medium") -> SystemSettings:
    return SystemSettings(date=time.strftime("%Y-%m-%d"), effort=effort)


def test_a_chat_request_is_rendered_in_harmony_and_parsed_by_channel(
    oai: openai.OpenAI, fake: FakeClusterClient, model: ModelInfo
) -> None:
    answer_with(fake, model, THOUGHT + FINAL, RETURN_ID)
    messages: list[Any] = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Weather in Oslo?"},
    ]
    reply = oai.chat.completions.create(
        model=model.name, messages=messages, tools=[WEATHER], reasoning_effort="high"
    )
    request = fake.submitted[0]
    expected = harmony.render(messages, [WEATHER["function"]], today("high"))
    assert prompt_of(model, request) == expected
    assert decode_token_ids(request.prompt_token_ids_b64) == model.tokenizer.encode(expected)
    assert request.output.parser_state == ParserState(reasoning_parser="harmony",
                                                      tool_parser="harmony")  # fmt: skip
    assert request.sampling.guided is None  # tool_choice auto: the model decides
    assert request.sampling.stop_token_ids == [RETURN_ID, CALL_ID]
    message = reply.choices[0].message
    assert (message.content, reply.choices[0].finish_reason) == ("It is sunny in Oslo.", "stop")
    assert message.model_extra == {"reasoning_content": "Need the weather."}


def test_a_tool_call_round_trip_streamed_and_not(
    oai: openai.OpenAI, fake: FakeClusterClient, model: ModelInfo
) -> None:
    answer_with(fake, model, THOUGHT + CALL, CALL_ID)
    messages: list[Any] = [{"role": "user", "content": "Weather in Oslo?"}]
    whole = oai.chat.completions.create(model=model.name, messages=messages, tools=[WEATHER])
    accumulator = ChatCompletionStreamState()
    for chunk in oai.chat.completions.create(
        model=model.name, messages=messages, tools=[WEATHER], stream=True
    ):
        accumulator.handle_chunk(chunk)
    streamed = accumulator.get_final_completion()
    for completion in (whole, streamed):
        choice = completion.choices[0]
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls or []
        assert call.function.name == "get_weather"  # type: ignore[union-attr]
        assert json.loads(call.function.arguments) == {"location": "Oslo"}  # type: ignore[union-attr]
    # the client runs the tool and sends the conversation back, the reasoning with the call
    call = whole.choices[0].message.tool_calls[0]  # type: ignore[index]
    assistant = {"role": "assistant", "content": None, "reasoning_content": "Need the weather.",
                 "tool_calls": [call.model_dump()]}  # fmt: skip
    result = {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny"}'}
    answer_with(fake, model, THOUGHT + FINAL, RETURN_ID)
    oai.chat.completions.create(
        model=model.name, messages=[*messages, assistant, result], tools=[WEATHER]
    )
    assert prompt_of(model, fake.submitted[-1]).endswith(
        "<|start|>user<|message|>Weather in Oslo?<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Need the weather.<|end|>"
        f"<|start|>assistant{CALL}<|call|>"
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{"sky": '
        '"sunny"}<|end|><|start|>assistant'
    )


def test_the_responses_route_renders_harmony_and_returns_reasoning_items(
    oai: openai.OpenAI, fake: FakeClusterClient, model: ModelInfo
) -> None:
    answer_with(fake, model, THOUGHT + CALL, CALL_ID)
    tool = {"type": "function", **WEATHER["function"]}
    first = oai.responses.create(model=model.name, input="Weather in Oslo?", tools=[tool],
                                 reasoning={"effort": "low"}, instructions="Be brief.")  # type: ignore[list-item]  # fmt: skip
    prompt = prompt_of(model, fake.submitted[0])
    assert "Reasoning: low" in prompt and "# Instructions\n\nBe brief." in prompt
    assert [item.type for item in first.output] == ["reasoning", "function_call"]
    # the reasoning item goes back before its call: kept while the call is answered
    answer_with(fake, model, THOUGHT + FINAL, RETURN_ID)
    call = first.output[1]
    assert call.type == "function_call"
    output = [item.model_dump(exclude_none=True) for item in first.output]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    items: Any = [{"role": "user", "content": "Weather in Oslo?"}, *output, result]
    second = oai.responses.create(model=model.name, input=items, tools=[tool])  # type: ignore[list-item]
    assert "<|channel|>analysis<|message|>Need the weather.<|end|>" in prompt_of(
        model, fake.submitted[-1]
    )
    assert second.output_text == "It is sunny in Oslo."


def test_previous_response_id_renders_the_stored_reasoning_before_its_call(
    oai: openai.OpenAI, fake: FakeClusterClient, model: ModelInfo
) -> None:
    """The stored conversation keeps the reasoning item: the follow-up by previous_response_id
    renders the prompt that sending the items back whole renders."""
    answer_with(fake, model, THOUGHT + CALL, CALL_ID)
    tool: Any = {"type": "function", **WEATHER["function"]}
    first = oai.responses.create(model=model.name, input="Weather in Oslo?", tools=[tool])
    call = first.output[1]
    assert call.type == "function_call"
    result: Any = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    answer_with(fake, model, THOUGHT + FINAL, RETURN_ID)
    chained = oai.responses.create(model=model.name, previous_response_id=first.id,
                                   input=[result], tools=[tool])  # fmt: skip
    output = [item.model_dump(exclude_none=True) for item in first.output]
    items: Any = [{"role": "user", "content": "Weather in Oslo?"}, *output, result]
    oai.responses.create(model=model.name, input=items, tools=[tool])
    by_id, whole = (prompt_of(model, request) for request in fake.submitted[-2:])
    assert by_id == whole
    assert "<|channel|>analysis<|message|>Need the weather.<|end|>" in by_id
    assert chained.output_text == "It is sunny in Oslo."


def test_anthropic_messages_on_gpt_oss_go_through_harmony(
    http: TestClient, fake: FakeClusterClient, model: ModelInfo
) -> None:
    answer_with(fake, model, THOUGHT + FINAL, RETURN_ID)
    body = {"model": model.name, "max_tokens": 64, "system": "Answer briefly.",
            "messages": [{"role": "user", "content": "Weather in Oslo?"}]}  # fmt: skip
    reply = http.post("/v1/messages", json=body)
    assert reply.status_code == 200, reply.text
    assert prompt_of(model, fake.submitted[0]) == harmony.render(
        [{"role": "system", "content": "Answer briefly."},
         {"role": "user", "content": "Weather in Oslo?"}], [], today())  # fmt: skip
    blocks = reply.json()["content"]
    assert blocks[-1] == {"type": "text", "text": "It is sunny in Oslo."}
    assert any(b["type"] == "thinking" and b["thinking"] == "Need the weather." for b in blocks)
    # thinking disabled: the least analysis harmony has (the model always reasons)
    reply = http.post("/v1/messages", json={**body, "thinking": {"type": "disabled"}})
    assert reply.status_code == 200, reply.text
    assert "Reasoning: low" in prompt_of(model, fake.submitted[1])


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"reasoning_effort": "none"}, "reasoning_effort"),
        ({"chat_template": "{{ messages }}"}, "chat_template"),
        ({"messages": [{"role": "tool", "content": "orphan", "tool_call_id": "x"}]}, "messages[0]"),
    ],
)
def test_what_harmony_cannot_render_is_a_400_naming_it(
    http: TestClient, model: ModelInfo, fields: dict[str, Any], param: str
) -> None:
    body = {"model": model.name, "messages": [{"role": "user", "content": "hi"}], **fields}
    reply = http.post("/v1/chat/completions", json=body)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param


def test_prompt_token_ids_pass_through(
    oai: openai.OpenAI, fake: FakeClusterClient, model: ModelInfo
) -> None:
    answer_with(fake, model, FINAL, RETURN_ID)
    ids = model.tokenizer.encode(harmony.render([{"role": "user", "content": "Hi"}], [], today()))
    reply = oai.chat.completions.create(
        model=model.name, messages=[{"role": "user", "content": "ignored"}],
        extra_body={"prompt_token_ids": ids},
    )  # fmt: skip
    assert decode_token_ids(fake.submitted[0].prompt_token_ids_b64) == ids
    assert reply.choices[0].message.content == "It is sunny in Oslo."


def test_a_thinking_budget_counts_the_analysis_channel(
    oai: openai.OpenAI, fake: FakeClusterClient, model: ModelInfo
) -> None:
    answer_with(fake, model, FINAL, RETURN_ID)
    oai.chat.completions.create(model=model.name, messages=[{"role": "user", "content": "Hi"}],
                                extra_body={"thinking_token_budget": 16})  # fmt: skip
    budget = fake.submitted[0].sampling.thinking_budget
    assert budget is not None and budget.end == [END_ID] and not budget.open_at_start
    assert [budget.start[0], budget.start[-1]] == [CHANNEL_ID, MESSAGE_ID]


# --- grammars -------------------------------------------------------------------------------------


def grammar_for(
    oai: openai.OpenAI, fake: FakeClusterClient, model: ModelInfo, **fields: Any
) -> Callable[[str], bool]:
    """The request's grammar (checked by llguidance with the model's tokenizer), as a test of
    whether it lets the model write `text` (then stop)."""
    answer_with(fake, model, FINAL, RETURN_ID)
    messages: Any = [{"role": "user", "content": "Weather in Oslo?"}]
    oai.chat.completions.create(model=model.name, messages=messages, **fields)
    guided = fake.submitted[-1].sampling.guided
    assert guided is not None
    check(guided, model.ll_tokenizer())

    def accepts(text: str) -> bool:
        matcher = llguidance.LLMatcher(model.ll_tokenizer(), guided.grammar, log_level=0)
        ids = model.tokenizer.encode(text)
        return all(matcher.consume_token(i) for i in ids) and matcher.is_accepting()

    return accepts


CALL_TEXT = CALL + "<|call|>"


def test_a_required_call_allows_the_analysis_then_exactly_one_call(
    oai: openai.OpenAI, fake: FakeClusterClient, model: ModelInfo
) -> None:
    for parallel in (True, False):
        accepts = grammar_for(oai, fake, model, tools=[WEATHER, TIME], tool_choice="required",
                              parallel_tool_calls=parallel)  # fmt: skip
        assert accepts(THOUGHT + CALL_TEXT) and accepts(CALL_TEXT)
        assert accepts("<|channel|>commentary to=functions.get_time <|constrain|>json"
                       "<|message|>{}<|call|>")  # fmt: skip
        assert not accepts(THOUGHT + FINAL)
        assert not accepts(CALL_TEXT.replace('"Oslo"', "42"))  # arguments under the schema
        assert not accepts(CALL_TEXT.replace("get_weather", "get_wether"))
        assert not accepts(THOUGHT + THOUGHT + CALL_TEXT)  # one analysis message, no more


def test_a_named_call_allows_only_that_function(
    oai: openai.OpenAI, fake: FakeClusterClient, model: ModelInfo
) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    accepts = grammar_for(oai, fake, model, tools=[WEATHER, TIME], tool_choice=named)
    assert accepts(THOUGHT + CALL_TEXT)
    assert not accepts("<|channel|>commentary to=functions.get_time <|constrain|>json"
                       "<|message|>{}<|call|>")  # fmt: skip
    assert not accepts(FINAL)


def test_tool_choice_none_allows_an_answer_and_no_call(
    oai: openai.OpenAI, fake: FakeClusterClient, model: ModelInfo
) -> None:
    accepts = grammar_for(oai, fake, model, tools=[WEATHER], tool_choice="none")
    assert accepts(THOUGHT + FINAL) and accepts(FINAL)
    assert not accepts(THOUGHT + CALL_TEXT)


SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
          "additionalProperties": False}  # fmt: skip


def test_response_format_shapes_the_final_channel(
    oai: openai.OpenAI, fake: FakeClusterClient, model: ModelInfo
) -> None:
    response_format: Any = {"type": "json_schema",
                            "json_schema": {"name": "place", "schema": SCHEMA}}  # fmt: skip
    accepts = grammar_for(oai, fake, model, response_format=response_format)
    assert accepts(THOUGHT + '<|channel|>final<|message|>{"city":"Oslo"}')
    assert not accepts(THOUGHT + FINAL)  # not JSON
    assert not accepts('<|channel|>final<|message|>{"town":"Oslo"}')
    assert "# Response Formats\n\n## place\n\n" in prompt_of(model, fake.submitted[-1])
    # beside tools (auto): the formatted answer or a call; with none: the answer only
    either = grammar_for(oai, fake, model, response_format=response_format, tools=[WEATHER])
    assert either(THOUGHT + CALL_TEXT) and either('<|channel|>final<|message|>{"city":"Oslo"}')
    only = grammar_for(oai, fake, model, response_format=response_format, tools=[WEATHER],
                       tool_choice="none")  # fmt: skip
    assert only('<|channel|>final<|message|>{"city":"Oslo"}') and not only(CALL_TEXT)


def test_guided_regex_and_grammar_shape_the_final_channel(
    oai: openai.OpenAI, fake: FakeClusterClient, model: ModelInfo
) -> None:
    for fields in ({"guided_regex": "[0-9]+ / [0-9]+"},
                   {"guided_grammar": 'start: NUM " / " NUM\nNUM: /[0-9]+/'}):  # fmt: skip
        accepts = grammar_for(oai, fake, model, extra_body=fields)
        assert accepts(THOUGHT + "<|channel|>final<|message|>12 / 7")
        assert not accepts(THOUGHT + "<|channel|>final<|message|>twelve")


def test_harmony_parser_state_travels_to_the_postproc_worker(
    oai: openai.OpenAI, fake: FakeClusterClient, model: ModelInfo
) -> None:
    answer_with(fake, model, FINAL, RETURN_ID)
    oai.chat.completions.create(model=model.name, messages=[{"role": "user", "content": "Hi"}])
    start = fake.submitted[0].postproc_start()
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(start.output), type=type(start.output))
    assert decoded.parser_state == ParserState(reasoning_parser="harmony")
