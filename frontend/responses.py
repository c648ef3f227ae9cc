"""POST /v1/responses: the OpenAI Responses API on the chat path.

input items ─▶ chat messages ─▶ chat.to_generate_request (template, tools, grammar, parsers)
                                 └▶ kind "responses": the postproc worker renders the
                                    Response object or its events (responses_format.py)

instructions                  → a system turn first
message items (any role)      → turns; input_text / output_text parts joined
function_call items           → an assistant turn's tool_calls
function_call_output items    → tool turns
reasoning items               → dropped (the template keeps no past reasoning); on a harmony
                                model, the reasoning_content of the assistant turn that
                                follows (kept while its calls are answered: common/harmony.py)
previous_response_id          → that response's input and output first (response_store.py;
                                its reasoning as above: kept on a harmony model only)
text.format                   → response_format;  reasoning.effort → reasoning_effort
max_output_tokens             → max_completion_tokens
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

import msgspec

from common.errors import InvalidRequest
from common.protocol import GenerateRequest
from common.responses_schema import ResponseSettings
from frontend import chat
from frontend.model_info import ModelInfo
from frontend.sampling import Temperature, TopP


class _Strict(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    pass


class ResponsesRequest(_Strict):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    max_output_tokens: int | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    seed: int | None = None  # an extension, as on the other routes
    # Accepted and ignored on purpose (nothing here could change the output): README lists them.
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    background: bool | None = None
    top_logprobs: int | None = None


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def _text(content: Any, where: str) -> str:
    """A message item's content as text: a string, or input_text / output_text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest("content must be a string or a list of text parts", where)
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise InvalidRequest(
                f"content parts of type {kind!r} are not supported: text only", where
            )
        texts.append(str(part.get("text", "")))
    return "\n".join(texts)


def _content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message item's content: its text, or, when it holds input_image parts, chat parts
    (text and image_url, in order) for a model that takes images (chat.check_images)."""
    if not isinstance(content, list) or not any(
        isinstance(p, dict) and p.get("type") == "input_image" for p in content
    ):
        return _text(content, where)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        if isinstance(part, dict) and part.get("type") == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str):
                raise InvalidRequest("an input_image needs an image_url (file_id is not "
                                     "supported)", f"{where}.content[{j}]")  # fmt: skip
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            parts.append({"type": "text", "text": _text([part], where)})
    return parts


def _reasoning_text(item: dict[str, Any]) -> str:
    parts = item.get("content") or []
    return "".join(str(p.get("text", "")) for p in parts if isinstance(p, dict))


def input_messages(
    items: str | list[dict[str, Any]], keep_reasoning: bool = False
) -> list[dict[str, Any]]:
    """Input items as chat messages (see the module docstring)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    reasoning: list[str] = []  # reasoning items not yet given to an assistant turn
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise InvalidRequest(f"a message's role must be user, system, developer or "
                                     f"assistant, got {role!r}", where)  # fmt: skip
            messages.append({"role": role, "content": _content(item.get("content", ""), where)})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}  # fmt: skip
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and not reasoning:
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text(output, where)
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
        elif kind != "reasoning":
            raise InvalidRequest(f"input items of type {kind!r} are not supported", where)
        elif keep_reasoning:
            reasoning.append(_reasoning_text(item))
            continue
        if reasoning and messages[-1]["role"] == "assistant":
            messages[-1]["reasoning_content"] = "\n".join(reasoning)
        reasoning = []
    return messages


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise InvalidRequest(
                f"tools of type {tool.get('type')!r} are not available here: function tools only",
                f"tools[{i}]",
            )
        function = {
            k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool
        }
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if isinstance(choice, dict):
        if choice.get("type") != "function" or "name" not in choice:
            raise InvalidRequest('tool_choice must be none, auto, required or '
                                 '{"type": "function", "name": ...}', "tool_choice")  # fmt: skip
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    spec = (text or {}).get("format")
    if spec is None or spec.get("type") == "text":
        return None
    if spec.get("type") == "json_object":
        return {"type": "json_object"}
    if spec.get("type") == "json_schema":
        json_schema = {k: spec[k] for k in ("name", "schema", "strict") if k in spec}
        return {"type": "json_schema", "json_schema": json_schema}
    raise InvalidRequest(f"text.format type {spec.get('type')!r} is not text, json_object or "
                         "json_schema", "text")  # fmt: skip


def as_chat_request(
    body: ResponsesRequest, history: list[dict[str, Any]], keep_reasoning: bool = False
) -> chat.ChatCompletionRequest:
    """The chat request the response is made by; `history`: the previous response's turns;
    `keep_reasoning`: reasoning items go to the assistant turn after them (harmony)."""
    if body.top_logprobs:
        raise InvalidRequest("top_logprobs are not available on /v1/responses", "top_logprobs")
    if body.background:
        raise InvalidRequest("background responses are not supported", "background")
    if not keep_reasoning:  # as input_messages drops reasoning items
        history = [{k: v for k, v in turn.items() if k != "reasoning_content"} for turn in history]
    messages = [*history, *input_messages(body.input, keep_reasoning)]
    if body.instructions:  # instructions are not carried over by previous_response_id
        messages.insert(0, {"role": "system", "content": body.instructions})
    if not messages:
        raise InvalidRequest("input must not be empty", "input")
    effort = (body.reasoning or {}).get("effort")
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "tools": _tools(body.tools),
        "tool_choice": _tool_choice(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": _response_format(body.text),
        "reasoning_effort": effort,
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "stream": body.stream,
        "seed": body.seed,
        "user": body.user,
    }
    try:
        return msgspec.convert(
            {k: v for k, v in fields.items() if v is not None}, chat.ChatCompletionRequest
        )
    except msgspec.ValidationError as e:
        raise InvalidRequest(f"input: {e}", "input") from None


def _echoed_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A function tool as the Response echoes it: `parameters` and `strict` always present
    (null when the request left them out), as the Response schema requires."""
    return {"parameters": None, "strict": None, **tool}


def settings(body: ResponsesRequest) -> ResponseSettings:
    """What the Response echoes of its request."""
    return ResponseSettings(
        instructions=body.instructions,
        max_output_tokens=body.max_output_tokens,
        parallel_tool_calls=body.parallel_tool_calls is not False,
        previous_response_id=body.previous_response_id,
        reasoning={"effort": (body.reasoning or {}).get("effort"), "summary": None},
        store=body.store,
        temperature=body.temperature,
        text=body.text or {"format": {"type": "text"}},
        tool_choice=body.tool_choice or "auto",
        tools=[_echoed_tool(tool) for tool in body.tools or []],
        top_p=body.top_p,
        user=body.user if body.user is not None else msgspec.UNSET,
        metadata=body.metadata or {},
    )


def to_generate_request(
    body: ResponsesRequest, history: list[dict[str, Any]], model: ModelInfo, reply_to: str
) -> GenerateRequest:
    generate = chat.to_generate_request(
        as_chat_request(body, history, keep_reasoning=model.harmony),
        model,
        reply_to,
        allow_request_template=False,
    )
    generate.request_id = new_response_id()
    generate.output.kind = "responses"
    generate.output.responses = settings(body)
    generate.output.created = int(time.time())
    return generate
