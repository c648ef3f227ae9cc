"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API on the same cluster.

The request becomes a chat completion request and takes the chat path (template, tools, tool
choice grammar, parsers) with OutputOptions.kind "anthropic": the postproc worker formats
Anthropic's message body or its streaming events. The conversation maps onto chat messages:

    system                           ─▶ system message
    user: tool_result blocks, text   ─▶ one tool message per result, then a user message
    assistant: thinking, text, tool_use ─▶ assistant message: reasoning_content, content,
                                           tool_calls (input as JSON arguments)
    tools / tool_choice auto|any|tool|none ─▶ tools / "auto"|"required"|named|"none"
    thinking enabled|disabled        ─▶ chat_template_kwargs enable_thinking

`thinking.budget_tokens` is checked as Anthropic does and enforced as the chat route's
thinking_token_budget (the engine forces the end of thinking when it is spent); max_tokens bounds
the whole answer. Images and server tools are refused (400).
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

import msgspec

from common.errors import InvalidRequest
from common.protocol import GenerateRequest
from frontend import chat
from frontend.chat import (
    ChatCompletionRequest,
    ContentPart,
    FunctionCall,
    FunctionDefinition,
    ImagePart,
    Message,
    TextPart,
    Tool,
    ToolCall,
    render_chat,
)
from frontend.model_info import ModelInfo


class _Strict(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class TextBlock(_Strict, tag_field="type", tag="text"):
    text: str
    cache_control: dict[str, Any] | None = None
    citations: list[dict[str, Any]] | None = None  # accepted, not used


class ThinkingBlock(_Strict, tag_field="type", tag="thinking"):
    thinking: str
    signature: str = ""


class ToolUseBlock(_Strict, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(_Strict, tag_field="type", tag="tool_result"):
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False
    cache_control: dict[str, Any] | None = None


class ImageSource(_Strict):
    type: Literal["base64", "url"]
    media_type: str | None = None  # base64: image/jpeg, image/png, image/gif or image/webp
    data: str | None = None
    url: str | None = None

    def as_url(self, param: str) -> str:
        """The image as the chat API's image_url (a data: URL for base64)."""
        if self.type == "url" and self.url:
            return self.url
        if self.type == "base64" and self.data and self.media_type:
            return f"data:{self.media_type};base64,{self.data}"
        needs = "url" if self.type == "url" else "media_type and data"
        raise InvalidRequest(f"an image source of type {self.type} needs {needs}", param)


class ImageBlock(_Strict, tag_field="type", tag="image"):
    source: ImageSource
    cache_control: dict[str, Any] | None = None


ContentBlock = TextBlock | ThinkingBlock | ToolUseBlock | ToolResultBlock | ImageBlock


class AnthropicMessage(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class ToolDefinition(_Strict):
    """A client tool; server tools (web search, code execution...) have a `type` and are refused."""

    name: str
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class ThinkingConfig(_Strict):
    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = None


class MessagesRequest(_Strict):
    model: str
    max_tokens: int
    messages: list[AnthropicMessage]
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    metadata: dict[str, Any] | None = None  # accepted, not used
    service_tier: str | None = None  # accepted, not used
    # extensions (older versions of the API had some): sampling controls
    temperature: float | None = None  # None: the model's default (frontend/sampling.py)
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None


class CountTokensRequest(_Strict):
    model: str
    messages: list[AnthropicMessage]
    system: str | list[TextBlock] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None


def as_chat(body: MessagesRequest | CountTokensRequest) -> ChatCompletionRequest:
    """The conversation, tools and thinking switch as a chat request (sampling left default)."""
    if not body.messages:
        raise InvalidRequest("messages must not be empty", "messages")
    messages = []
    if body.system:
        system = body.system
        text = system if isinstance(system, str) else "\n".join(b.text for b in system)
        messages.append(Message(role="system", content=text))
    for i, message in enumerate(body.messages):
        if isinstance(message.content, str):
            messages.append(Message(role=message.role, content=message.content))
        elif message.role == "user":
            messages.extend(_user_turn(message.content, f"messages[{i}].content"))
        else:
            messages.append(_assistant_turn(message.content, f"messages[{i}].content"))
    return ChatCompletionRequest(
        model=body.model,
        messages=messages,
        tools=[_tool(t, f"tools[{i}]") for i, t in enumerate(body.tools)] if body.tools else None,
        tool_choice=_tool_choice(body.tool_choice),
        parallel_tool_calls=False
        if body.tool_choice and body.tool_choice.disable_parallel_tool_use
        else None,
        chat_template_kwargs=(
            {"enable_thinking": body.thinking.type == "enabled"} if body.thinking else None
        ),
    )


def _user_turn(blocks: list[ContentBlock], param: str) -> list[Message]:
    """Tool results first (one tool message each, as chat templates expect), then the text."""
    results: list[Message] = []
    texts: list[ContentPart] = []
    for block in blocks:
        if isinstance(block, ToolResultBlock):
            content = block.content
            text = content if isinstance(content, str) else "\n".join(b.text for b in content)
            results.append(Message(role="tool", tool_call_id=block.tool_use_id, content=text))
        elif isinstance(block, TextBlock):
            texts.append(TextPart(text=block.text))
        elif isinstance(block, ImageBlock):
            texts.append(ImagePart(image_url={"url": block.source.as_url(param)}))
        else:
            raise InvalidRequest(f"a user message cannot hold a {_tag(block)} block", param)
    return results + ([Message(role="user", content=texts)] if texts or not results else [])


def _assistant_turn(blocks: list[ContentBlock], param: str) -> Message:
    reasoning: list[str] = []
    texts: list[ContentPart] = []
    calls: list[ToolCall] = []
    for block in blocks:
        if isinstance(block, ThinkingBlock):
            reasoning.append(block.thinking)
        elif isinstance(block, TextBlock):
            texts.append(TextPart(text=block.text))
        elif isinstance(block, ToolUseBlock):
            arguments = msgspec.json.encode(block.input).decode()
            call = FunctionCall(name=block.name, arguments=arguments)
            calls.append(ToolCall(id=block.id, function=call))
        else:
            raise InvalidRequest(f"an assistant message cannot hold a {_tag(block)} block", param)
    return Message(
        role="assistant",
        content=texts or None,
        tool_calls=calls or None,
        reasoning_content="".join(reasoning) or None,
    )


def _tag(block: ContentBlock) -> str:
    return str(block.__struct_config__.tag)


def _tool(tool: ToolDefinition, param: str) -> Tool:
    if tool.input_schema.get("type") != "object":
        raise InvalidRequest("input_schema must be a JSON schema of type object", param)
    return Tool(
        function=FunctionDefinition(
            name=tool.name, description=tool.description, parameters=tool.input_schema
        )
    )


def _tool_choice(choice: ToolChoice | None) -> str | dict[str, Any] | None:
    if choice is None:
        return None
    if choice.type == "tool":
        if not choice.name:
            raise InvalidRequest('tool_choice of type "tool" needs a name', "tool_choice")
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def count_tokens(body: CountTokensRequest, model: ModelInfo) -> int:
    rendered = render_chat(as_chat(body), model)
    model.check_prompt_chars(len(rendered.prompt_text), "messages")
    return len(model.tokenizer.encode(rendered.prompt_text))


def to_generate_request(body: MessagesRequest, model: ModelInfo, reply_to: str) -> GenerateRequest:
    # Anthropic's own ranges: temperature in [0, 1]; a thinking budget of at least 1024 tokens
    # and below max_tokens
    if body.temperature is not None and not 0.0 <= body.temperature <= 1.0:
        raise InvalidRequest(
            f"temperature must be in [0, 1], got {body.temperature}", "temperature"
        )
    budget = body.thinking.budget_tokens if body.thinking else None
    if (
        body.thinking
        and body.thinking.type == "enabled"
        and (budget is None or not 1024 <= budget < body.max_tokens)
    ):
        raise InvalidRequest(
            "thinking.budget_tokens must be at least 1024 and less than max_tokens",
            "thinking.budget_tokens",
        )
    request = msgspec.structs.replace(
        as_chat(body),
        thinking_token_budget=budget if body.thinking and body.thinking.type == "enabled" else None,
        max_tokens=body.max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        seed=body.seed,
        stop=body.stop_sequences,
        stream=body.stream,
    )
    generate = chat.to_generate_request(request, model, reply_to, allow_request_template=False)
    generate.request_id = f"msg_{uuid.uuid4().hex}"  # Anthropic's id style
    generate.output.kind = "anthropic"
    return generate
