"""Structured output, tool calls and reasoning through the `openai` SDK on a disaggregated cluster.
The tiny model writes nonsense on its own: only the constraints make these outputs valid."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.integration.harness import MODEL, Cluster, stop

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
        "tags": {"type": "array", "items": {"enum": ["sun", "rain"]}, "maxItems": 3},
    },
    "required": ["city", "days", "tags"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["utc", "cet"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# The tiny model thinks as Qwen3 does: with thinking on, a required call's grammar lets it open a
# <think> block first, where its random weights may ramble past max_tokens. The tests of the
# calls themselves turn thinking off; test_required_calls_let_a_thinking_model_finish_its_thought
# covers thinking first.
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def cluster(start_cluster) -> Cluster:
    return start_cluster("disaggregated")


@pytest.fixture(scope="module")
def oai(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.base_url, api_key="unused", timeout=120, max_retries=0)


def chat(oai: openai.OpenAI, **options):
    options = {"model": MODEL, "messages": ASK, "max_tokens": 120, "temperature": 1.0, **options}
    return oai.chat.completions.create(**options)


def test_json_schema_responses_validate_for_20_seeds(oai) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}

    def one(seed: int) -> str:
        result = chat(oai, seed=seed, response_format=response_format)
        assert result.choices[0].finish_reason == "stop"
        return result.choices[0].message.content

    with ThreadPoolExecutor(4) as pool:
        for content in pool.map(one, range(20)):
            jsonschema.validate(json.loads(content), SCHEMA)


def check_calls(calls, names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        schema = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), schema["function"]["parameters"])


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_required_tool_choice_always_calls_a_tool(oai, seed: int) -> None:
    result = chat(
        oai, seed=seed, tools=[WEATHER, TIME], tool_choice="required", extra_body=NO_THINKING
    )
    choice = result.choices[0]
    assert choice.finish_reason == "tool_calls"
    check_calls(choice.message.tool_calls, {"get_weather", "get_time"})


@pytest.mark.parametrize("seed", [4, 5])
def test_named_tool_choice_calls_that_tool_streaming_and_not(oai, seed: int) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    result = chat(oai, seed=seed, tools=[WEATHER, TIME], tool_choice=named)
    assert result.choices[0].finish_reason == "tool_calls"
    check_calls(result.choices[0].message.tool_calls, {"get_time"})

    with oai.chat.completions.stream(
        model=MODEL, messages=ASK, max_tokens=120, temperature=1.0, seed=seed,
        tools=[WEATHER, TIME], tool_choice=named,
    ) as stream:  # fmt: skip
        final = stream.get_final_completion()
    assert final.choices[0].finish_reason == "tool_calls"
    check_calls(final.choices[0].message.tool_calls, {"get_time"})
    streamed = final.choices[0].message.tool_calls[0].function.arguments
    assert json.loads(streamed) == json.loads(
        result.choices[0].message.tool_calls[0].function.arguments
    )


def test_required_tool_calls_stream(oai) -> None:
    with oai.chat.completions.stream(
        model=MODEL, messages=ASK, max_tokens=120, temperature=1.0, seed=9,
        tools=[WEATHER], tool_choice="required", extra_body=NO_THINKING,
    ) as stream:  # fmt: skip
        final = stream.get_final_completion()
    check_calls(final.choices[0].message.tool_calls, {"get_weather"})


def test_reasoning_is_split_from_content(oai) -> None:
    grammar = (
        "start: <think> /[a-z]{3,8}( [a-z]{3,8}){0,3}/ </think> /[a-z]{3,8}( [a-z]{3,8}){0,3}/"
    )
    result = chat(oai, seed=2, extra_body={"guided_grammar": grammar})
    message = result.choices[0].message
    assert message.reasoning_content and "<think>" not in message.reasoning_content
    assert message.content and "think>" not in message.content
    chunks = list(chat(oai, seed=2, stream=True, extra_body={"guided_grammar": grammar}))
    reasoning = "".join(
        getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices
    )
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert (reasoning, content) == (message.reasoning_content, message.content)


def test_completions_guided_regex(oai) -> None:
    result = oai.completions.create(
        model=MODEL, prompt="Order number:", max_tokens=20, temperature=1.0, seed=1,
        extra_body={"guided_regex": "[0-9]{4}-[A-Z]{2}"},
    )  # fmt: skip
    assert re.fullmatch(r"[0-9]{4}-[A-Z]{2}", result.choices[0].text)


def test_a_forced_call_beside_a_response_format_is_a_400(oai) -> None:
    """The seed's rule: a forced call leaves no text for the format to shape, and keeping
    either would drop the client's other instruction (tool_choice auto beside a format is
    served: the answer in the format, or calls)."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    with pytest.raises(openai.BadRequestError, match="forced tool_choice") as refused:
        chat(oai, tools=[WEATHER], tool_choice=named, response_format={"type": "json_object"})
    assert refused.value.body["param"] == "response_format"


# --- the same tools through the Anthropic Messages API --------------------------------------------

ANTHROPIC_TOOLS = [
    {"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
    | ({"description": t["function"]["description"]} if "description" in t["function"] else {})
    for t in (WEATHER, TIME)
]


@pytest.fixture(scope="module")
def claude(cluster: Cluster) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=cluster.url, api_key="unused", timeout=120, max_retries=0)


def check_tool_uses(message, names: set[str]) -> list:
    uses = [b for b in message.content if b.type == "tool_use"]
    assert uses and message.stop_reason == "tool_use"
    for use in uses:
        assert use.name in names and use.id.startswith("toolu_")  # Anthropic's id style
        schema = {"get_weather": WEATHER, "get_time": TIME}[use.name]
        jsonschema.validate(use.input, schema["function"]["parameters"])
    return uses


@pytest.mark.parametrize("seed", [1, 2])
def test_anthropic_tool_choice_makes_tool_use_blocks_streaming_and_not(claude, seed) -> None:
    options = {"model": MODEL, "max_tokens": 120, "messages": ASK, "tools": ANTHROPIC_TOOLS,
               "extra_body": {"seed": seed}}  # fmt: skip
    named = {"type": "tool", "name": "get_time"}
    check_tool_uses(claude.messages.create(**options, tool_choice=named), {"get_time"})
    with claude.messages.stream(**options, tool_choice=named) as stream:
        streamed = check_tool_uses(stream.get_final_message(), {"get_time"})
    any_tool = claude.messages.create(
        **options, tool_choice={"type": "any"}, thinking={"type": "disabled"}
    )
    check_tool_uses(any_tool, {"get_weather", "get_time"})
    assert (
        streamed[0].input
        == check_tool_uses(claude.messages.create(**options, tool_choice=named), {"get_time"})[
            0
        ].input
    )  # the seed makes the same call, streamed or not


def test_anthropic_tool_results_render_like_chat_tool_messages(claude, oai) -> None:
    """The turn with tool_use blocks and the next with tool_result blocks reach the template as
    the chat API's assistant tool_calls and tool messages: the same prompt tokens."""
    call_input = {"city": "Paris"}
    conversation = [
        *ASK,
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": call_input},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny, 21 C"},
            {"type": "text", "text": "And tomorrow?"},
        ]},
    ]  # fmt: skip
    counted = claude.messages.count_tokens(
        model=MODEL, messages=conversation, tools=ANTHROPIC_TOOLS
    ).input_tokens
    arguments = json.dumps(call_input, separators=(",", ":"))
    chat_messages = [
        *ASK,
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}],
         "tool_calls": [{"id": "toolu_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny, 21 C"},
        {"role": "user", "content": [{"type": "text", "text": "And tomorrow?"}]},
    ]  # fmt: skip
    chat_result = chat(oai, messages=chat_messages, tools=[WEATHER, TIME], max_tokens=1)
    assert counted == chat_result.usage.prompt_tokens
    answer = claude.messages.create(
        model=MODEL, max_tokens=8, messages=conversation, tools=ANTHROPIC_TOOLS
    )
    assert answer.usage.input_tokens + (answer.usage.cache_read_input_tokens or 0) == counted


def test_blocks_are_free_afterwards(cluster) -> None:
    info = cluster.wait_idle()
    for worker in info.workers:
        assert worker.blocks_used == 0 and worker.blocks_leased == 0, worker


def test_the_forced_call_prefix_is_not_billed(oai) -> None:
    """The seed's prompt_tokens_excluded_from_usage: a named tool choice appends the call's
    opening to the prompt, which the model reads but the client did not send."""
    named = {"type": "function", "function": {"name": "get_time"}}
    forced = chat(oai, seed=4, tools=[WEATHER, TIME], tool_choice=named)
    auto = chat(oai, seed=4, tools=[WEATHER, TIME], tool_choice="auto", max_tokens=2)
    assert forced.usage.prompt_tokens == auto.usage.prompt_tokens > 0  # the same template
    with oai.chat.completions.stream(
        model=MODEL, messages=ASK, max_tokens=120, temperature=1.0, seed=4,
        tools=[WEATHER, TIME], tool_choice=named, stream_options={"include_usage": True},
    ) as stream:  # fmt: skip
        final = stream.get_final_completion()
    assert final.usage.prompt_tokens == auto.usage.prompt_tokens


def test_a_thinking_budget_forces_the_end_of_thinking_across_the_hand_off(
    oai, cluster: Cluster
) -> None:
    """The first token is sampled on the context worker, the rest on the generation worker,
    which replays it into the budget's state. A bias makes `<think>` the argmax at every step,
    so only the budget can close a block."""
    tokens = httpx.post(
        f"{cluster.base_url}/tokenize",
        json={"model": MODEL, "prompt": "<think></think>"},
        timeout=10,
    ).json()["tokens"]
    think, end = tokens
    options = {"temperature": 0.0, "max_tokens": 8, "logprobs": True,
               "logit_bias": {str(think): 100}}  # fmt: skip

    def token_strings(**extra) -> list[str]:
        result = chat(oai, **options, extra_body={"ignore_eos": True, **extra})
        return [t.token for t in result.choices[0].logprobs.content]

    assert token_strings() == ["<think>"] * 8
    budgeted = token_strings(thinking_token_budget=3)
    assert budgeted == ["<think>"] * 4 + ["</think>", "<think>", "</think>", "<think>"]
    with pytest.raises(openai.BadRequestError) as refused:
        chat(oai, extra_body={"thinking_token_budget": 3, "guided_regex": "[a-z]+"})
    assert refused.value.body["param"] == "thinking_token_budget"


def test_required_calls_let_a_thinking_model_finish_its_thought(oai, cluster: Cluster) -> None:
    """A prompt that leaves the model inside <think> (here given as ids: the template's output
    and an opened block): the required call's grammar lets the thought end first, then forces
    the call. A bias makes </think> the model's first choice; before, the grammar forbade it
    and the output had to open with the call. The thought ends on the context worker, the call
    is made on the generation worker."""
    tokenize = f"{cluster.base_url}/tokenize"
    rendered = httpx.post(tokenize, json={"model": MODEL, "messages": ASK}, timeout=10).json()
    opened = httpx.post(tokenize, json={"model": MODEL, "prompt": "<think>\n"}, timeout=10).json()
    end = httpx.post(tokenize, json={"model": MODEL, "prompt": "</think>"}, timeout=10).json()
    result = chat(
        oai, tools=[WEATHER], tool_choice="required", temperature=0.0, logprobs=True,
        logit_bias={str(end["tokens"][0]): 100},
        extra_body={"prompt_token_ids": rendered["tokens"] + opened["tokens"]},
    )  # fmt: skip
    choice = result.choices[0]
    assert choice.logprobs.content[0].token == "</think>"
    assert choice.finish_reason == "tool_calls"
    check_calls(choice.message.tool_calls, {"get_weather"})


@pytest.mark.parametrize("tool_parser", ["llama3_json", "mistral", "deepseek_v3"])
def test_forced_calls_take_the_format_of_the_tool_parser_in_use(
    start_cluster, tool_parser: str
) -> None:
    """A model served with another tool parser is forced into that parser's format (not
    Hermes' tags), so the calls come back parsed: required and named. (One call each: the
    tiny model's random weights would go on adding parallel calls until max_tokens; the
    grammar's parallel calls are checked in tests/unit/engine/test_guided.py.)"""
    served = start_cluster("aggregated", extra=f"tool_parser: {tool_parser}")
    pids = [w.pid for w in served.info().workers]
    try:
        check_forced_calls(served)
    finally:
        stop(served, pids)  # now, not with the module: one such cluster at a time


def check_forced_calls(served: Cluster) -> None:
    client = openai.OpenAI(base_url=served.base_url, api_key="unused", timeout=120, max_retries=0)
    named = {"type": "function", "function": {"name": "get_time"}}
    for seed in (1, 2):
        required = chat(client, seed=seed, tools=[WEATHER, TIME], tool_choice="required",
                        parallel_tool_calls=False, extra_body=NO_THINKING)  # fmt: skip
        assert required.choices[0].finish_reason == "tool_calls", required
        check_calls(required.choices[0].message.tool_calls, {"get_weather", "get_time"})
        one = chat(client, seed=seed, tools=[WEATHER, TIME], tool_choice=named,
                   extra_body=NO_THINKING)  # fmt: skip
        assert one.choices[0].finish_reason == "tool_calls", one
        check_calls(one.choices[0].message.tool_calls, {"get_time"})
        assert len(one.choices[0].message.tool_calls) == 1
