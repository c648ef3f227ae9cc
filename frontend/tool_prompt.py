"""Tools for models whose chat template ignores them (SmolLM2's ChatML template, many others).

Such a template renders `messages` only: the tool list would never reach the model, an assistant
turn holding only `tool_calls` would render as empty (or fail on its `None` content), and tool
results would come out under a role the model never saw. So before rendering, the frontend
rewrites the conversation into plain turns that teach the format of the tool parser in use:

    tools                      → instructions + the tool list, appended to the system turn
                                 (a system turn is added if there is none)
    assistant tool_calls       → the calls as text in the parser's format, after any content
    tool messages              → one user turn per run of results, in the format's wrapping

The parser in the postproc worker reads the model's answer in the same format, and forced calls
(tool_choice required / named) are constrained to it, so tool calling works the same way as with
a template that lists tools itself.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Call = tuple[str, str]  # (name, arguments as JSON text)


def _json_arguments(arguments: str) -> str:
    """The arguments as compact JSON; text that is not JSON is kept as a JSON string."""
    try:
        return json.dumps(json.loads(arguments), ensure_ascii=False)
    except ValueError:
        return json.dumps(arguments, ensure_ascii=False)


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """How one tool-call format is taught: the system-turn text and how turns are written."""

    instructions: str  # "{tools}": the tools, one JSON object a line; "{tools_json}": an array
    calls: Callable[[list[Call]], str]
    results: Callable[[list[str]], str]


def _hermes_calls(calls: list[Call]) -> str:
    return "\n".join(
        f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": {_json_arguments(args)}}}\n'
        "</tool_call>"
        for name, args in calls
    )


def _llama3_calls(calls: list[Call]) -> str:
    return "; ".join(
        f'{{"name": {json.dumps(name)}, "parameters": {_json_arguments(args)}}}'
        for name, args in calls
    )


def _mistral_calls(calls: list[Call]) -> str:
    items = ", ".join(
        f'{{"name": {json.dumps(name)}, "arguments": {_json_arguments(args)}}}'
        for name, args in calls
    )
    return f"[TOOL_CALLS][{items}]"


def _deepseek_calls(calls: list[Call]) -> str:
    body = "".join(
        f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{_json_arguments(args)}\n```"
        "<｜tool▁call▁end｜>"
        for name, args in calls
    )
    return f"<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>"


TOOL_FORMATS: dict[str, ToolFormat] = {
    "hermes": ToolFormat(
        instructions=(
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            "<tools>\n{tools}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags:\n"
            '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n'
            "</tool_call>"
        ),
        calls=_hermes_calls,
        results=lambda results: "\n".join(
            f"<tool_response>\n{result}\n</tool_response>" for result in results
        ),
    ),
    "llama3_json": ToolFormat(
        instructions=(
            "You have access to the following functions:\n\n{tools}\n\n"
            "To call a function, respond with only a JSON object of the form "
            '{{"name": function name, "parameters": dictionary of argument name and its value}}. '
            "Do not use variables."
        ),
        calls=_llama3_calls,
        results=lambda results: "\n".join(f"Function output: {result}" for result in results),
    ),
    "mistral": ToolFormat(
        instructions="[AVAILABLE_TOOLS]{tools_json}[/AVAILABLE_TOOLS]",
        calls=_mistral_calls,
        results=lambda results: "".join(
            f"[TOOL_RESULTS]{json.dumps({'content': r}, ensure_ascii=False)}[/TOOL_RESULTS]"
            for r in results
        ),
    ),
    "deepseek_v3": ToolFormat(
        instructions=(
            "## Tools\n\nYou can call these functions:\n{tools}\n\n"
            "To call functions, answer with <｜tool▁calls▁begin｜>, then for each call "
            "<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\nARGUMENTS\n```"
            "<｜tool▁call▁end｜>, then <｜tool▁calls▁end｜>."
        ),
        calls=_deepseek_calls,
        results=lambda results: "".join(
            f"<｜tool▁output▁begin｜>{result}<｜tool▁output▁end｜>" for result in results
        ),
    ),
}
TOOL_FORMATS["qwen3"] = TOOL_FORMATS["hermes"]


def fold_tools(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, tool_parser: str
) -> list[dict[str, Any]]:
    """`messages` (template dicts, content already text) with tools, calls and results as text."""
    fmt = TOOL_FORMATS[tool_parser]
    out: list[dict[str, Any]] = []
    pending_results: list[str] = []
    for message in messages:
        if message["role"] == "tool":
            pending_results.append(message.get("content") or "")
            continue
        if pending_results:
            out.append({"role": "user", "content": fmt.results(pending_results)})
            pending_results = []
        calls = message.get("tool_calls")
        if message["role"] == "assistant" and calls:
            text = fmt.calls([(c["function"]["name"], c["function"]["arguments"]) for c in calls])
            content = message.get("content") or ""
            message = {**message, "content": f"{content}\n{text}" if content else text}
            message.pop("tool_calls")
        out.append(message)
    if pending_results:
        out.append({"role": "user", "content": fmt.results(pending_results)})
    if tools:
        instructions = fmt.instructions.format(
            tools="\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools),
            tools_json=json.dumps(tools, ensure_ascii=False),
        )
        if out and out[0]["role"] == "system":
            system = out[0].get("content") or ""
            out[0] = {**out[0], "content": f"{system}\n\n{instructions}".lstrip("\n")}
        else:
            out.insert(0, {"role": "system", "content": instructions})
    return out
