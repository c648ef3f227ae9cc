"""gpt-oss's harmony format end to end through a real cluster, disaggregated (KV over NIXL) and
aggregated, with the official `openai` and `anthropic` SDKs: the frontend renders harmony, the
engine runs builtin:tiny-gpt-oss, the postproc pool's harmony parser turns its channels into
reasoning, content and tool calls.

Chat Completions (reasoning and content, streamed and not, a tool call round trip, tool_choice
none / required / named), the Responses API (reasoning, message and function_call items, a
function_call_output round trip given whole and through previous_response_id) and Anthropic
Messages (thinking and text blocks). The chat path is checked token for token: its rendered
prompt is what the harmony renderer gives transformers' tokenizer, and its output is
transformers `generate` on those ids.

The tiny checkpoint (1M parameters, trained ~40 s at build time) learned harmony's structure,
not the world, and its weights differ with each machine's float rounding: the assertions are on
structure (which channels, which function, arguments that parse and follow the schema) and on
agreement (streamed vs whole, cluster vs transformers, one route vs another), never on the
words of an answer. After a tool's result it may call the tool again: that turn sets
tool_choice "none", which the harmony grammar turns into a final answer.

Slow (two clusters, a transformers reference): `long`.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anthropic
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from common import harmony
from tests.integration import openai_spec
from tests.integration.harness import Cluster, launch, stop

pytestmark = pytest.mark.long

MODEL = "builtin:tiny-gpt-oss"
MAX_NEW = 160  # the tiny model's answers take 40-70 tokens
MARKER = re.compile(r"<\|[a-z_]+\|>")  # any harmony structure token, as text
PLAIN = [{"role": "user", "content": "What is the capital of France?"}]
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER_RESULT = json.dumps({"temperature": 21, "condition": "sunny"})


def _function(name: str, description: str, properties: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": name,
        "description": description,
        "parameters": {"type": "object", "properties": properties, "required": list(properties)},
    }


WEATHER = _function(
    "get_weather",
    "Gets the current weather in a city.",
    {"location": {"type": "string", "description": "The city, e.g. Paris"}},
)
TIME = _function("get_time", "Gets the local time in a city.", {"city": {"type": "string"}})
CHAT_TOOLS: Any = [{"type": "function", "function": f} for f in (WEATHER, TIME)]
RESPONSES_TOOLS: Any = [{"type": "function", **f} for f in (WEATHER, TIME)]
ANTHROPIC_TOOLS: Any = [
    {"name": f["name"], "description": f["description"], "input_schema": f["parameters"]}
    for f in (WEATHER, TIME)
]


@pytest.fixture(scope="module", params=["disaggregated", "aggregated"])
def cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    """A cluster serving the tiny gpt-oss in the mode (its own response store); stopped after
    the mode's tests."""
    from engine.builtin_build import ensure_builtin

    ensure_builtin(MODEL)  # built here, not inside `up`'s start-up timeout
    tmp = tmp_path_factory.mktemp(f"harmony-{request.param}")
    store = f"responses_store: {tmp / 'responses.sqlite3'}"
    started = launch(tmp, request.param, MODEL, frontend=store)
    pids = [w.pid for w in started.info().workers]
    yield started
    stop(started, pids)


@pytest.fixture(scope="module")
def oai(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.base_url, api_key="-", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def claude(cluster: Cluster) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=cluster.url, api_key="-", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def reference() -> Any:
    """transformers' own model and tokenizer for the checkpoint (torch imported only here)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.builtin_build import ensure_builtin

    path = ensure_builtin(MODEL)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


def chat(oai: openai.OpenAI, messages: list[Any], **options: Any) -> Any:
    options = {"max_tokens": MAX_NEW, "temperature": 0, **options}
    return oai.chat.completions.create(
        model=MODEL, messages=messages, extra_body={"return_token_ids": True}, **options
    )


def chat_streamed(oai: openai.OpenAI, messages: list[Any], **options: Any) -> list[Any]:
    return list(chat(oai, messages, stream=True, stream_options={"include_usage": True},
                     **options))  # fmt: skip


def no_markers(*objects: Any) -> None:
    """Nothing the client sees holds harmony's structure tokens as text."""
    for obj in objects:
        text = obj.model_dump_json()
        assert not MARKER.search(text), MARKER.findall(text)


def assert_idle(cluster: Cluster) -> None:
    info = cluster.wait_idle()
    busy = [w for w in info.workers if w.blocks_used or w.blocks_leased or w.active_requests]
    assert not busy, busy


def arguments(call: Any, function: dict[str, Any]) -> dict[str, Any]:
    """A call's arguments parsed, with the function's required keys (strings, as declared)."""
    parsed = json.loads(call.arguments)
    assert isinstance(parsed, dict)
    for key in function["parameters"]["required"]:
        assert isinstance(parsed[key], str), (key, parsed)
    return parsed


def hf_greedy_ids(reference: Any, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    import torch

    model, _ = reference
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, do_sample=False, max_new_tokens=max_new_tokens,
                             pad_token_id=model.generation_config.pad_token_id)  # fmt: skip
    return out[0, len(prompt_ids) :].tolist()


# --- chat completions -------------------------------------------------------------------------


def test_chat_gives_reasoning_and_content_streamed_and_not(
    cluster: Cluster, oai: openai.OpenAI
) -> None:
    whole = chat(oai, PLAIN)
    (choice,) = whole.choices
    reasoning = choice.message.model_extra["reasoning_content"]
    assert reasoning and choice.message.content and not choice.message.tool_calls
    assert choice.finish_reason == "stop"
    token_ids = choice.model_extra["token_ids"]
    assert whole.usage.completion_tokens == len(token_ids) < MAX_NEW
    assert whole.usage.prompt_tokens == len(whole.model_extra["prompt_token_ids"])
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    no_markers(whole)

    chunks = chat_streamed(oai, PLAIN)
    no_markers(*chunks)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    streamed_ids = [
        i for c in chunks for ch in c.choices for i in ch.model_extra.get("token_ids", [])
    ]
    assert streamed_ids == token_ids
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert_idle(cluster)


def test_an_answer_cut_between_its_messages_shows_the_reasoning_and_no_header(
    cluster: Cluster, oai: openai.OpenAI, reference: Any
) -> None:
    """max_tokens ending anywhere from the analysis's <|end|> to the final's <|message|>: the
    whole reasoning, no content, finish_reason "length", streamed and not (the cut role and
    channel are the next message's header, never text)."""
    _, tokenizer = reference
    whole = chat(oai, PLAIN)
    token_ids = whole.choices[0].model_extra["token_ids"]
    end = token_ids.index(harmony_id(tokenizer, harmony.END))
    opened = token_ids.index(harmony_id(tokenizer, harmony.MESSAGE), end)
    reasoning = whole.choices[0].message.model_extra["reasoning_content"]
    for max_tokens in range(end + 1, opened + 2):
        cut = chat(oai, PLAIN, max_tokens=max_tokens)
        chunks = chat_streamed(oai, PLAIN, max_tokens=max_tokens)
        no_markers(cut, *chunks)
        (choice,) = cut.choices
        assert choice.finish_reason == "length"
        assert choice.message.model_extra["reasoning_content"] == reasoning
        assert not choice.message.content, max_tokens
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert not "".join(d.content or "" for d in deltas), max_tokens
    assert_idle(cluster)


def test_a_tool_call_round_trip_streamed_and_not(cluster: Cluster, oai: openai.OpenAI) -> None:
    whole = chat(oai, ASK_WEATHER, tools=CHAT_TOOLS)
    accumulator = ChatCompletionStreamState()
    chunks = chat_streamed(oai, ASK_WEATHER, tools=CHAT_TOOLS)
    for chunk in chunks:
        accumulator.handle_chunk(chunk)
    streamed = accumulator.get_final_completion()
    no_markers(whole, *chunks)
    for completion in (whole, streamed):
        (choice,) = completion.choices
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather" and call.id
        arguments(call.function, WEATHER)
    call = whole.choices[0].message.tool_calls[0]
    assert streamed.choices[0].message.tool_calls[0].function.arguments == call.function.arguments
    reasoning = whole.choices[0].message.model_extra["reasoning_content"]
    assert reasoning
    # the client runs the tool and sends back its call (with the reasoning) and the result
    assistant = whole.choices[0].message.model_dump(exclude_none=True)
    assert assistant["reasoning_content"] == reasoning
    history = [*ASK_WEATHER, assistant,
               {"role": "tool", "tool_call_id": call.id, "content": WEATHER_RESULT}]  # fmt: skip
    answer = chat(oai, history, tools=CHAT_TOOLS, tool_choice="none")
    chunks = chat_streamed(oai, history, tools=CHAT_TOOLS, tool_choice="none")
    no_markers(answer, *chunks)
    (choice,) = answer.choices
    assert choice.message.content and not choice.message.tool_calls
    assert choice.finish_reason == "stop"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        choice.message.content
    )
    assert_idle(cluster)


@pytest.mark.parametrize(
    ("tool_choice", "expected"),
    [
        ("required", None),
        ({"type": "function", "function": {"name": "get_time"}}, "get_time"),
        ({"type": "function", "function": {"name": "get_weather"}}, "get_weather"),
    ],
)
def test_tool_choice_required_or_named_makes_exactly_one_call(
    cluster: Cluster, oai: openai.OpenAI, tool_choice: Any, expected: str | None
) -> None:
    """A question no tool answers, with tool_choice required or a named function: the grammar
    makes the model call (the named function), once, with arguments that follow its schema."""
    completion = chat(oai, PLAIN, tools=CHAT_TOOLS, tool_choice=tool_choice)
    no_markers(completion)
    (choice,) = completion.choices
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    functions = {"get_weather": WEATHER, "get_time": TIME}
    assert call.function.name in functions if expected is None else call.function.name == expected
    arguments(call.function, functions[call.function.name])
    assert choice.message.model_extra["reasoning_content"]
    assert_idle(cluster)


def test_greedy_chat_is_transformers_generate_on_the_harmony_prompt(
    cluster: Cluster, oai: openai.OpenAI, reference: Any
) -> None:
    """The prompt ids the cluster rendered are transformers' tokenizer on the harmony renderer's
    text, and the output ids are transformers `generate` on them: a plain question, a call, and
    the turn after the tool's result (tool_choice auto: no grammar between the model and its
    greedy choice), asked at once (one continuous batch, parsed by the postproc pool's
    workers side by side)."""
    _, tokenizer = reference
    first = chat(oai, ASK_WEATHER, tools=CHAT_TOOLS)
    call = first.choices[0].message.tool_calls[0]
    result = {"role": "tool", "tool_call_id": call.id, "content": WEATHER_RESULT}
    after_result = [*ASK_WEATHER, first.choices[0].message.model_dump(exclude_none=True), result]
    asked = [(PLAIN, []), (ASK_WEATHER, CHAT_TOOLS), (after_result, CHAT_TOOLS)]
    with ThreadPoolExecutor(len(asked)) as pool:
        completions = list(pool.map(lambda a: chat(oai, a[0], tools=a[1] or openai.omit), asked))
    settings = harmony.SystemSettings(date=time.strftime("%Y-%m-%d"))
    stops = [harmony_id(tokenizer, harmony.RETURN), harmony_id(tokenizer, harmony.CALL)]
    for (messages, tools), completion in zip(asked, completions, strict=True):
        prompt_ids = completion.model_extra["prompt_token_ids"]
        text = harmony.render(messages, [t["function"] for t in tools], settings)
        assert prompt_ids == tokenizer.encode(text, add_special_tokens=False)
        output_ids = completion.choices[0].model_extra["token_ids"]
        assert output_ids == hf_greedy_ids(reference, prompt_ids, MAX_NEW)
        assert output_ids[-1] in stops
    assert completions[1].choices[0].message.tool_calls[0].function == call.function
    assert_idle(cluster)


def harmony_id(tokenizer: Any, marker: str) -> int:
    return int(tokenizer.convert_tokens_to_ids(marker))


# --- the Responses API ------------------------------------------------------------------------


def respond(oai: openai.OpenAI, **options: Any) -> Any:
    return oai.responses.create(model=MODEL, max_output_tokens=MAX_NEW, temperature=0, **options)


def respond_streamed(oai: openai.OpenAI, **options: Any) -> tuple[Any, list[Any]]:
    """(the response.completed event's Response, every event)."""
    events = list(respond(oai, stream=True, **options))
    for event in events:
        body = event.model_dump(mode="json", exclude_unset=True)
        openai_spec.check(openai_spec.RESPONSE_EVENTS[event.type], body)
    assert events[-1].type == "response.completed"
    return events[-1].response, events


def items(response: Any) -> list[tuple[str, str]]:
    """The output as (type, text): reasoning text, message text, or `name(arguments)`."""
    out = []
    for item in response.output:
        if item.type == "reasoning":
            out.append(("reasoning", "".join(part.text for part in item.content or [])))
        elif item.type == "message":
            out.append(("message", "".join(part.text for part in item.content)))
        else:
            out.append((item.type, f"{item.name}({item.arguments})"))
    return out


def test_responses_give_reasoning_and_message_items_streamed_and_not(
    cluster: Cluster, oai: openai.OpenAI
) -> None:
    whole = respond(oai, input=PLAIN[0]["content"])
    openai_spec.check("Response", whole.model_dump(mode="json", exclude_unset=True))
    streamed, events = respond_streamed(oai, input=PLAIN[0]["content"])
    no_markers(whole, *events)
    assert whole.status == "completed"
    assert [kind for kind, _ in items(whole)] == ["reasoning", "message"]
    assert all(text for _, text in items(whole))
    assert items(streamed) == items(whole)
    # the same prompt and greedy output as chat's
    completion = chat(oai, PLAIN)
    message = completion.choices[0].message
    assert items(whole) == [("reasoning", message.model_extra["reasoning_content"]),
                            ("message", message.content)]  # fmt: skip
    assert whole.usage.input_tokens == completion.usage.prompt_tokens
    assert whole.usage.output_tokens == completion.usage.completion_tokens
    assert_idle(cluster)


def test_responses_give_a_function_call_item_streamed_and_not(
    cluster: Cluster, oai: openai.OpenAI
) -> None:
    question = ASK_WEATHER[0]["content"]
    whole = respond(oai, input=question, tools=RESPONSES_TOOLS)
    streamed, events = respond_streamed(oai, input=question, tools=RESPONSES_TOOLS)
    no_markers(whole, *events)
    assert [kind for kind, _ in items(whole)] == ["reasoning", "function_call"]
    assert items(streamed) == items(whole)
    call = whole.output[1]
    assert call.name == "get_weather" and call.call_id and call.status == "completed"
    arguments(call, WEATHER)
    assert_idle(cluster)


def test_a_function_call_output_round_trip_whole_and_by_previous_response_id(
    cluster: Cluster, oai: openai.OpenAI
) -> None:
    """The tool's result goes back with the whole conversation as input items, or with only
    `previous_response_id` (stored, streamed or not): the same prompt (its reasoning item
    kept, as harmony keeps the analysis of calls still being answered) and the same answer,
    the prompt chat renders for the same turns."""
    question = ASK_WEATHER[0]["content"]
    first = respond(oai, input=question, tools=RESPONSES_TOOLS)
    first_streamed, _ = respond_streamed(oai, input=question, tools=RESPONSES_TOOLS)
    call = first.output[1]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": WEATHER_RESULT}
    given = [{"role": "user", "content": question},
             *(item.model_dump(exclude_none=True) for item in first.output), result]  # fmt: skip
    whole = respond(oai, input=given, tools=RESPONSES_TOOLS, tool_choice="none")
    chained = respond(oai, previous_response_id=first.id, input=[result], tools=RESPONSES_TOOLS,
                      tool_choice="none")  # fmt: skip
    result_streamed = {**result, "call_id": first_streamed.output[1].call_id}
    chained_streamed, events = respond_streamed(
        oai, previous_response_id=first_streamed.id, input=[result_streamed],
        tools=RESPONSES_TOOLS, tool_choice="none",
    )  # fmt: skip
    no_markers(whole, chained, chained_streamed, *events)
    assert [kind for kind, _ in items(whole)] == ["reasoning", "message"]
    assert all(text for _, text in items(whole))
    assert items(chained) == items(chained_streamed) == items(whole)
    assert whole.usage.input_tokens == chained.usage.input_tokens
    assert chained.usage.input_tokens == chained_streamed.usage.input_tokens
    # chat, with the call's reasoning sent back, renders the same prompt
    function = {"name": call.name, "arguments": call.arguments}
    calls = [{"id": call.call_id, "type": "function", "function": function}]
    assistant = {"role": "assistant", "content": None, "reasoning_content": items(first)[0][1],
                 "tool_calls": calls}  # fmt: skip
    tool = {"role": "tool", "tool_call_id": call.call_id, "content": WEATHER_RESULT}
    history = [*ASK_WEATHER, assistant, tool]
    completion = chat(oai, history, tools=CHAT_TOOLS, tool_choice="none")
    assert completion.usage.prompt_tokens == whole.usage.input_tokens
    assert completion.choices[0].message.content == items(whole)[1][1]
    assert_idle(cluster)


# --- Anthropic Messages -----------------------------------------------------------------------


def blocks(message: Any) -> list[tuple[str, str]]:
    return [(b.type, b.thinking if b.type == "thinking" else b.text) for b in message.content]


def test_anthropic_messages_give_thinking_and_text_streamed_and_not(
    cluster: Cluster, oai: openai.OpenAI, claude: anthropic.Anthropic
) -> None:
    options: Any = {"model": MODEL, "max_tokens": MAX_NEW, "messages": PLAIN,
                    "extra_body": {"temperature": 0}}  # fmt: skip
    whole = claude.messages.create(**options)
    with claude.messages.stream(**options) as stream:
        events = list(stream)
        streamed = stream.get_final_message()
    no_markers(whole, streamed, *events)
    for message in (whole, streamed):
        assert [block.type for block in message.content] == ["thinking", "text"]
        assert message.stop_reason == "end_turn"
    assert blocks(streamed) == blocks(whole)
    thinking, text = whole.content
    completion = chat(oai, PLAIN)
    assert thinking.thinking == completion.choices[0].message.model_extra["reasoning_content"]
    assert text.text == completion.choices[0].message.content
    assert whole.usage.output_tokens == completion.usage.completion_tokens
    assert_idle(cluster)


def test_anthropic_tool_use_round_trip(cluster: Cluster, claude: anthropic.Anthropic) -> None:
    options: Any = {"model": MODEL, "max_tokens": MAX_NEW, "tools": ANTHROPIC_TOOLS,
                    "extra_body": {"temperature": 0}}  # fmt: skip
    first = claude.messages.create(messages=ASK_WEATHER, **options)
    no_markers(first)
    assert [block.type for block in first.content] == ["thinking", "tool_use"]
    assert first.stop_reason == "tool_use"
    use = first.content[1]
    assert use.name == "get_weather" and isinstance(use.input["location"], str)
    result = {"type": "tool_result", "tool_use_id": use.id, "content": WEATHER_RESULT}
    history: Any = [*ASK_WEATHER, {"role": "assistant", "content": first.content},
                    {"role": "user", "content": [result]}]  # fmt: skip
    answer = claude.messages.create(messages=history, tool_choice={"type": "none"}, **options)
    no_markers(answer)
    assert [block.type for block in answer.content] == ["thinking", "text"]
    assert answer.stop_reason == "end_turn" and answer.content[1].text
    assert_idle(cluster)
