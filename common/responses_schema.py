"""OpenAI Responses API shapes: the Response object, its output items, and the stream events.

The postproc workers encode them (kind "responses"); the frontend decodes a finished Response to
store it for `previous_response_id` and GET /v1/responses/{id}. Field sets follow the official
OpenAPI description; fields this server has no use for are sent as their documented defaults.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import UNSET, UnsetType

Status = Literal["completed", "incomplete", "in_progress"]


class _Item(msgspec.Struct, kw_only=True, tag_field="type"):
    pass


class OutputText(msgspec.Struct, kw_only=True, tag_field="type", tag="output_text"):
    text: str
    annotations: list[Any] = msgspec.field(default_factory=list)
    logprobs: list[Any] = msgspec.field(default_factory=list)


class ReasoningText(msgspec.Struct, kw_only=True, tag_field="type", tag="reasoning_text"):
    text: str


class MessageItem(_Item, tag="message"):
    id: str
    role: Literal["assistant"] = "assistant"
    status: Status = "completed"
    content: list[OutputText] = msgspec.field(default_factory=list)


class FunctionCallItem(_Item, tag="function_call"):
    id: str
    call_id: str
    name: str
    arguments: str  # JSON text
    status: Status = "completed"


class ReasoningItem(_Item, tag="reasoning"):
    id: str
    summary: list[Any] = msgspec.field(default_factory=list)
    content: list[ReasoningText] = msgspec.field(default_factory=list)
    status: Status = "completed"


OutputItem = MessageItem | FunctionCallItem | ReasoningItem


class InputTokensDetails(msgspec.Struct, kw_only=True):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(msgspec.Struct, kw_only=True):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct, kw_only=True):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(msgspec.Struct, kw_only=True):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseSettings(msgspec.Struct, kw_only=True):
    """The request's settings a Response echoes back: made by the frontend, carried to the
    postproc worker in OutputOptions.responses."""

    instructions: str | None = None
    max_output_tokens: int | None = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] = msgspec.field(default_factory=dict)
    store: bool = True
    temperature: float | None = None
    text: dict[str, Any] = msgspec.field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = msgspec.field(default_factory=list)
    top_p: float | None = None
    truncation: str = "disabled"
    user: str | UnsetType = UNSET  # left out unless the request set it (not nullable)
    metadata: dict[str, str] = msgspec.field(default_factory=dict)


class Response(ResponseSettings, kw_only=True):
    """The Response object: the output, and the settings it was made with."""

    id: str
    object_: Literal["response"] = msgspec.field(default="response", name="object")
    created_at: int
    status: Status = "completed"
    error: None = None
    incomplete_details: IncompleteDetails | None = None
    model: str
    output: list[OutputItem] = msgspec.field(default_factory=list)
    usage: ResponseUsage | UnsetType = UNSET  # once finished


# --- stream events (each with the stream's running sequence_number) ------------------------------


class _Event(msgspec.Struct, kw_only=True, tag_field="type"):
    sequence_number: int = 0


class ResponseCreated(_Event, tag="response.created"):
    response: Response


class ResponseInProgress(_Event, tag="response.in_progress"):
    response: Response


class ResponseCompleted(_Event, tag="response.completed"):
    response: Response


class ResponseIncomplete(_Event, tag="response.incomplete"):
    response: Response


class OutputItemAdded(_Event, tag="response.output_item.added"):
    output_index: int
    item: OutputItem


class OutputItemDone(_Event, tag="response.output_item.done"):
    output_index: int
    item: OutputItem


class ContentPartAdded(_Event, tag="response.content_part.added"):
    item_id: str
    output_index: int
    content_index: int
    part: OutputText | ReasoningText


class ContentPartDone(_Event, tag="response.content_part.done"):
    item_id: str
    output_index: int
    content_index: int
    part: OutputText | ReasoningText


class OutputTextDelta(_Event, tag="response.output_text.delta"):
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] = msgspec.field(default_factory=list)


class OutputTextDone(_Event, tag="response.output_text.done"):
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] = msgspec.field(default_factory=list)


class ReasoningTextDelta(_Event, tag="response.reasoning_text.delta"):
    item_id: str
    output_index: int
    content_index: int
    delta: str


class ReasoningTextDone(_Event, tag="response.reasoning_text.done"):
    item_id: str
    output_index: int
    content_index: int
    text: str


class FunctionCallArgumentsDelta(_Event, tag="response.function_call_arguments.delta"):
    item_id: str
    output_index: int
    delta: str


class FunctionCallArgumentsDone(_Event, tag="response.function_call_arguments.done"):
    item_id: str
    output_index: int
    name: str
    arguments: str


StreamEvent = (
    ResponseCreated
    | ResponseInProgress
    | ResponseCompleted
    | ResponseIncomplete
    | OutputItemAdded
    | OutputItemDone
    | ContentPartAdded
    | ContentPartDone
    | OutputTextDelta
    | OutputTextDone
    | ReasoningTextDelta
    | ReasoningTextDone
    | FunctionCallArgumentsDelta
    | FunctionCallArgumentsDone
)
