"""Chat conversations rendered in OpenAI's harmony format, the one gpt-oss was trained on.

A prompt is a run of messages, each `<|start|>{header}<|message|>{content}<|end|>`, ending with
the generation prompt `<|start|>assistant` (the model then writes `<|channel|>...` itself):

    system      model identity, knowledge cutoff, current date, `Reasoning: low|medium|high`,
                the valid channels (and, with tools, that calls go to the commentary channel)
    developer   `# Instructions` (the request's system and developer messages, in order),
                `# Tools` (common/harmony_typescript.py), `# Response Formats` (a JSON schema)
    user        as given
    assistant   from history: its reasoning as an `analysis` message only while its tool calls
                are still being answered (no final answer after it yet: the harmony rule, as in
                the gpt-oss chat template); its content as `final` (or, beside tool calls, as a
                `commentary` preamble); each call as
                `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGS<|call|>`
    tool        `<|start|>functions.NAME to=assistant<|channel|>commentary<|message|>RESULT<|end|>`

The text follows OpenAI's harmony documentation and renderer (`openai-harmony`): the tests
compare the two (tests/unit/common/test_harmony_reference.py). One documented difference: that
renderer writes a call's recipient after the role (`assistant to=functions.f<|channel|>...`);
here it follows the channel, as the documentation's examples and the model's own output do.
Past assistant text goes back as it was written, so the markers in it are markers.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from common.errors import InvalidRequest
from common.harmony_typescript import tool_namespace

START = "<|start|>"
END = "<|end|>"
MESSAGE = "<|message|>"
CHANNEL = "<|channel|>"
CONSTRAIN = "<|constrain|>"
RETURN = "<|return|>"  # the end of a final answer: a stop token
CALL = "<|call|>"  # the end of a tool call: a stop token
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)  # the structure's tokens

MODEL_IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."
KNOWLEDGE_CUTOFF = "2024-06"
CHANNELS = ("analysis", "commentary", "final")
GENERATION_PROMPT = f"{START}assistant"
FUNCTION_RECIPIENT_PREFIX = "functions."

ReasoningEffort = Literal["low", "medium", "high"]


@dataclass(frozen=True, slots=True)
class ResponseFormat:
    """A JSON schema the final answer must follow, declared in the developer message."""

    name: str
    schema: dict[str, Any]
    description: str | None = None


@dataclass(frozen=True, slots=True)
class SystemSettings:
    """What the system message says; `date` is the conversation's (YYYY-MM-DD)."""

    date: str
    effort: ReasoningEffort = "medium"
    model_identity: str = MODEL_IDENTITY


def message(header: str, content: str, end: str = END) -> str:
    return f"{START}{header}{MESSAGE}{content}{end}"


def call_header(name: str) -> str:
    """What the model writes after `<|start|>assistant` to call function `name`."""
    return f"{CHANNEL}commentary to={FUNCTION_RECIPIENT_PREFIX}{name} {CONSTRAIN}json{MESSAGE}"


def system_message(settings: SystemSettings, has_functions: bool) -> str:
    channels = (
        f"# Valid channels: {', '.join(CHANNELS)}. Channel must be included for every message."
    )
    if has_functions:
        channels += "\nCalls to these tools must go to the commentary channel: 'functions'."
    sections = [
        f"{settings.model_identity}\nKnowledge cutoff: {KNOWLEDGE_CUTOFF}\n"
        f"Current date: {settings.date}",
        f"Reasoning: {settings.effort}",
        channels,
    ]
    return message("system", "\n\n".join(sections))


def developer_message(
    instructions: str | None,
    functions: Sequence[dict[str, Any]],
    response_format: ResponseFormat | None = None,
) -> str:
    """The developer message, or "" when there is nothing to say."""
    sections = []
    if instructions is not None:
        sections += ["# Instructions", instructions]
    if functions:
        sections.append("# Tools\n\n" + tool_namespace(functions))
    if response_format is not None:
        schema = json.dumps(response_format.schema, ensure_ascii=False, separators=(",", ":"))
        comment = f"// {response_format.description}\n" if response_format.description else ""
        sections.append(f"# Response Formats\n\n## {response_format.name}\n\n{comment}{schema}")
    return message("developer", "\n\n".join(sections)) if sections else ""


def call_message(name: str, arguments: str) -> str:
    return f"{START}assistant{call_header(name)}{arguments}{CALL}"


def tool_result_message(name: str, result: str) -> str:
    return message(f"{FUNCTION_RECIPIENT_PREFIX}{name} to=assistant{CHANNEL}commentary", result)


def render(
    messages: Sequence[dict[str, Any]],
    functions: Sequence[dict[str, Any]],
    settings: SystemSettings,
    *,
    response_format: ResponseFormat | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """A conversation (chat messages as plain dicts: role, content as text, tool_calls,
    tool_call_id, name, reasoning_content) and its function tools (`{"name", "description",
    "parameters"}`) as a harmony prompt. Raises InvalidRequest naming the bad message."""
    instructions = [
        m.get("content") or "" for m in messages if m["role"] in ("system", "developer")
    ]
    parts = [
        system_message(settings, bool(functions)),
        developer_message(
            "\n\n".join(instructions) if instructions else None, functions, response_format
        ),
    ]
    call_names: dict[str, str] = {}  # tool_call_id -> function name, for the results
    for i, msg in enumerate(messages):
        role = msg["role"]
        if role == "user":
            parts.append(message("user", msg.get("content") or ""))
        elif role == "assistant":
            answered_later = any(
                m["role"] == "assistant" and not m.get("tool_calls") for m in messages[i + 1 :]
            )
            parts.append(_assistant(msg, keep_reasoning=not answered_later, names=call_names))
        elif role == "tool":
            parts.append(tool_result_message(_result_name(msg, call_names, i), _content(msg)))
        elif role not in ("system", "developer"):
            raise InvalidRequest(f"a message's role cannot be {role!r}", f"messages[{i}]")
    if add_generation_prompt:
        parts.append(GENERATION_PROMPT)
    return "".join(parts)


def _content(msg: dict[str, Any]) -> str:
    return str(msg.get("content") or "")


def _assistant(msg: dict[str, Any], *, keep_reasoning: bool, names: dict[str, str]) -> str:
    """One assistant turn: a final answer, or (reasoning,) (preamble,) calls."""
    calls = msg.get("tool_calls") or []
    if not calls:  # a final answer: its reasoning is dropped (the harmony rule)
        return message(f"assistant{CHANNEL}final", _content(msg))
    parts = []
    reasoning = msg.get("reasoning_content")
    if reasoning and keep_reasoning:
        parts.append(message(f"assistant{CHANNEL}analysis", reasoning))
    if msg.get("content"):
        parts.append(message(f"assistant{CHANNEL}commentary", _content(msg)))
    for call in calls:
        function = call["function"]
        names[call.get("id") or ""] = function["name"]
        parts.append(call_message(function["name"], function.get("arguments") or ""))
    return "".join(parts)


def _result_name(msg: dict[str, Any], names: dict[str, str], index: int) -> str:
    """The function a tool result answers: the call its tool_call_id names, else `name`."""
    name = names.get(msg.get("tool_call_id") or "") or msg.get("name")
    if not name:
        raise InvalidRequest(
            "a tool message must answer an earlier tool call (tool_call_id) or name its function",
            f"messages[{index}]",
        )
    return str(name)
