"""common/harmony.py against the strings OpenAI's harmony guide quotes (openai/harmony,
docs/format.md, "Function calling" and "Handling reasoning output in subsequent sampling"), and
its refusals. test_harmony_reference.py compares it with the reference renderer itself."""

from __future__ import annotations

from typing import Any

import pytest

from common import harmony
from common.errors import InvalidRequest
from common.harmony import ResponseFormat, SystemSettings

# docs/format.md, "Function calling": the three functions of its complete input example.
FUNCTIONS: list[dict[str, Any]] = [
    {"name": "get_location", "description": "Gets the location of the user."},
    {
        "name": "get_current_weather",
        "description": "Gets the current weather in the provided location.",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {
                    "type": "string",
                    "description": "The city and state, e.g. San Francisco, CA",
                },
                "format": {
                    "type": "string",
                    "enum": ["celsius", "fahrenheit"],
                    "default": "celsius",
                },  # fmt: skip
            },
            "required": ["location"],
        },
    },
    {
        "name": "get_multiple_weathers",
        "description": "Gets the current weather in the provided list of locations.",
        "parameters": {
            "type": "object",
            "properties": {
                "locations": {
                    "type": "array",
                    "items": {"type": "string"},
                    "description": 'List of city and state, e.g. ["San Francisco, CA", '
                    '"New York, NY"]',
                },
                "format": {
                    "type": "string",
                    "enum": ["celsius", "fahrenheit"],
                    "default": "celsius",
                },  # fmt: skip
            },
            "required": ["locations"],
        },
    },
]

# docs/format.md, "Function calling": the input once the tool output is back (verbatim).
DOCUMENTED_ROUND_TRIP = (
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    "Knowledge cutoff: 2024-06\nCurrent date: 2025-06-28\n\nReasoning: high\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message.\n"
    "Calls to these tools must go to the commentary channel: 'functions'.<|end|>"
    "<|start|>developer<|message|># Instructions\n\nUse a friendly tone.\n\n# Tools\n\n"
    "## functions\n\nnamespace functions {\n\n"
    "// Gets the location of the user.\ntype get_location = () => any;\n\n"
    "// Gets the current weather in the provided location.\n"
    "type get_current_weather = (_: {\n"
    "// The city and state, e.g. San Francisco, CA\nlocation: string,\n"
    'format?: "celsius" | "fahrenheit", // default: celsius\n}) => any;\n\n'
    "// Gets the current weather in the provided list of locations.\n"
    "type get_multiple_weathers = (_: {\n"
    '// List of city and state, e.g. ["San Francisco, CA", "New York, NY"]\n'
    "locations: string[],\n"
    'format?: "celsius" | "fahrenheit", // default: celsius\n}) => any;\n\n'
    "} // namespace functions<|end|>"
    "<|start|>user<|message|>What is the weather like in SF?<|end|>"
    "<|start|>assistant<|channel|>analysis<|message|>Need to use function get_weather.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"location":"San Francisco"}<|call|>'
    "<|start|>functions.get_weather to=assistant<|channel|>commentary"
    '<|message|>{"sunny": true, "temperature": 20}<|end|>'
    "<|start|>assistant"
)
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"location":"San Francisco"}'},
}
ROUND_TRIP: list[dict[str, Any]] = [
    {"role": "system", "content": "Use a friendly tone."},
    {"role": "user", "content": "What is the weather like in SF?"},
    {
        "role": "assistant",
        "content": None,
        "reasoning_content": "Need to use function get_weather.",
        "tool_calls": [CALL],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"sunny": true, "temperature": 20}'},
]
HIGH = SystemSettings(date="2025-06-28", effort="high")


def test_the_documented_tool_round_trip() -> None:
    assert harmony.render(ROUND_TRIP, FUNCTIONS, HIGH) == DOCUMENTED_ROUND_TRIP


def test_past_reasoning_is_dropped_once_a_final_answer_follows() -> None:
    """docs/format.md: after `2 + 2 = 4.` the next input is the user turn, the answer (ending
    in <|end|> in history, per its implementation note) and the new question; no analysis."""
    messages = [
        {"role": "user", "content": "What is 2 + 2?"},
        {
            "role": "assistant",
            "content": "2 + 2 = 4.",
            "reasoning_content": 'User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.',
        },
        {"role": "user", "content": "What about 9 / 2?"},
    ]
    text = harmony.render(messages, [], HIGH)
    assert text.endswith(
        "<|start|>user<|message|>What is 2 + 2?<|end|>"
        "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|end|>"
        "<|start|>user<|message|>What about 9 / 2?<|end|>"
        "<|start|>assistant"
    )
    # the call's reasoning goes too, once the calls were answered by a final message
    answered = [*ROUND_TRIP, {"role": "assistant", "content": "Sunny, 20°C."}]
    assert "Need to use function" not in harmony.render(answered, FUNCTIONS, HIGH)


def test_no_developer_message_without_instructions_or_tools() -> None:
    user = [{"role": "user", "content": "Hi"}]
    text = harmony.render(user, [], SystemSettings(date="2025-01-02"))
    assert text == (
        "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
        "Knowledge cutoff: 2024-06\nCurrent date: 2025-01-02\n\nReasoning: medium\n\n"
        "# Valid channels: analysis, commentary, final. Channel must be included for every "
        "message.<|end|><|start|>user<|message|>Hi<|end|><|start|>assistant"
    )


def test_a_response_format_is_declared_as_the_guide_shows() -> None:
    """docs/format.md, "Structured output": `# Response Formats`, `## {name}`, a comment with
    the description, the schema as compact JSON, at the end of the developer message."""
    schema = {"type": "object", "properties": {"items": {"type": "array"}}}
    fmt = ResponseFormat("shopping_list", schema, "entries on the shopping list")
    text = harmony.developer_message("You are a helpful shopping assistant", [], fmt)
    assert text == (
        "<|start|>developer<|message|># Instructions\n\nYou are a helpful shopping assistant"
        "\n\n# Response Formats\n\n## shopping_list\n\n// entries on the shopping list\n"
        '{"type":"object","properties":{"items":{"type":"array"}}}<|end|>'
    )


def test_a_tool_result_names_its_call_or_is_refused() -> None:
    named = [{"role": "tool", "name": "lookup", "content": "42"}]
    assert "<|start|>functions.lookup to=assistant" in harmony.render(named, [], HIGH)
    for bad in ([{"role": "tool", "tool_call_id": "nope", "content": "42"}],
                [{"role": "function", "content": "x"}]):  # fmt: skip
        with pytest.raises(InvalidRequest) as refused:
            harmony.render(bad, [], HIGH)
        assert refused.value.param == "messages[0]"
