"""Tools for templates that ignore them: the conversation rewritten in the tool parser's format,
rendered with SmolLM2's own template (which has no tool support), and read back by the parser."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from common.config import ClusterConfig
from frontend.chat import ChatCompletionRequest, render_chat
from frontend.chat_template import takes_tools
from frontend.model_info import ModelInfo, load_model_info
from frontend.tool_prompt import TOOL_FORMATS, fold_tools
from postproc_worker.parsers import TOOL_PARSERS
from postproc_worker.parsers.tools import ToolCallArguments, ToolCallStart

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
ARGUMENTS = {"city": "Oslo", "note": 'quotes " and braces }'}
CONVERSATION = [
    {
        "role": "user",
        "content": [{"type": "text", "text": "Weather in"}, {"type": "text", "text": "Oslo?"}],
    },
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps(ARGUMENTS)},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "4 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "windy"},
]


@pytest.fixture(scope="module")
def smollm2(smollm2_path: Path) -> ModelInfo:
    return load_model_info(ClusterConfig(model="builtin:smollm2-135m"))


def test_the_template_analysis_tells_which_templates_read_tools(
    smollm2: ModelInfo, tiny_model_path: Path
) -> None:
    tiny = load_model_info(ClusterConfig(model="builtin:tiny"))
    assert tiny.tokenizer.chat_template is not None and takes_tools(tiny.tokenizer.chat_template)
    assert smollm2.tokenizer.chat_template is not None
    assert not takes_tools(smollm2.tokenizer.chat_template)
    assert smollm2.tool_parser == "hermes"  # the builtin's choice, not llama's llama3_json


def test_smollm2_renders_tools_calls_and_results_in_the_hermes_format(smollm2: ModelInfo) -> None:
    body = msgspec.convert(
        {"model": smollm2.name, "messages": CONVERSATION, "tools": [WEATHER_TOOL]},
        ChatCompletionRequest,
    )
    text = render_chat(body, smollm2).prompt_text
    assert text.startswith("<|im_start|>system\n# Tools\n\nYou may call one or more functions")
    listed = text.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]
    assert [json.loads(line) for line in listed.splitlines()] == [WEATHER_TOOL]
    assert "<|im_start|>user\nWeather in\nOslo?<|im_end|>\n" in text
    call = json.dumps({"name": "get_weather", "arguments": ARGUMENTS}, ensure_ascii=False)
    assert f"<|im_start|>assistant\n<tool_call>\n{call}\n</tool_call><|im_end|>\n" in text
    assert (
        "<|im_start|>user\n<tool_response>\n4 C\n</tool_response>\n"
        "<tool_response>\nwindy\n</tool_response><|im_end|>\n"
    ) in text
    assert text.endswith("<|im_start|>assistant\n")
    assert "None" not in text


def test_an_existing_system_turn_keeps_its_text_before_the_tools() -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    folded = fold_tools(messages, [WEATHER_TOOL], "hermes")
    assert len(folded) == 2 and folded[0]["content"].startswith("Be brief.\n\n# Tools")
    assert fold_tools(messages, None, "hermes") == messages  # nothing to fold


@pytest.mark.parametrize("parser", sorted(TOOL_FORMATS))
def test_each_format_writes_calls_its_parser_reads_back(parser: str) -> None:
    calls = [("get_weather", json.dumps(ARGUMENTS)), ("get_time", "{}")]
    text = TOOL_FORMATS[parser].calls(calls)
    tool_parser = TOOL_PARSERS[parser]()
    events = tool_parser.feed(text) + tool_parser.finish()
    names = [e.name for e in events if isinstance(e, ToolCallStart)]
    arguments: dict[int, str] = {}
    for event in events:
        if isinstance(event, ToolCallArguments):
            arguments[event.index] = arguments.get(event.index, "") + event.text
    assert names == ["get_weather", "get_time"], (parser, text, events)
    assert [json.loads(arguments[i]) for i in range(2)] == [ARGUMENTS, {}]
    assert not [e for e in events if isinstance(e, str)], text  # nothing left as content


@pytest.mark.parametrize("parser", sorted(TOOL_FORMATS))
def test_each_format_lists_the_tools_in_the_system_turn(parser: str) -> None:
    folded = fold_tools([{"role": "user", "content": "Hi"}], [WEATHER_TOOL], parser)
    assert folded[0]["role"] == "system" and '"get_weather"' in folded[0]["content"]
    assert "{tools" not in folded[0]["content"]
