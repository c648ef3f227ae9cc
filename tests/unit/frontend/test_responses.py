"""The Responses request as the chat request it is served by (frontend/responses.py): what a
stored conversation's reasoning becomes, and how the Response echoes its tools."""

from __future__ import annotations

from typing import Any

from frontend.responses import ResponsesRequest, as_chat_request, settings
from tests.integration import openai_spec

CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"location": "Oslo"}'}}  # fmt: skip
HISTORY: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "reasoning_content": "Need the weather.",
     "tool_calls": [CALL]},
]  # fmt: skip
RESULT = {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}


def test_a_stored_turns_reasoning_goes_on_only_where_reasoning_items_would() -> None:
    body = ResponsesRequest(model="m", input=[RESULT], previous_response_id="resp_1")
    kept = as_chat_request(body, HISTORY, keep_reasoning=True).messages
    assert kept[1].reasoning_content == "Need the weather."
    dropped = as_chat_request(body, HISTORY, keep_reasoning=False).messages
    assert dropped[1].reasoning_content is None and dropped[1].tool_calls
    assert [m.role for m in dropped] == ["user", "assistant", "tool"]
    assert HISTORY[1]["reasoning_content"] == "Need the weather."  # the stored turns as they were


def test_the_response_echoes_function_tools_as_the_schema_requires() -> None:
    tools = [{"type": "function", "name": "get_time"},
             {"type": "function", "name": "add", "parameters": {"type": "object"},
              "strict": True}]  # fmt: skip
    echoed = settings(ResponsesRequest(model="m", input="hi", tools=tools)).tools
    assert echoed == [
        {"type": "function", "name": "get_time", "parameters": None, "strict": None},
        {"type": "function", "name": "add", "parameters": {"type": "object"}, "strict": True},
    ]
    for tool in echoed:
        openai_spec.check("FunctionTool", tool)
