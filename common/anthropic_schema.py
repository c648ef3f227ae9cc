"""Anthropic Messages API response shapes (a Message body and its stream events) as Structs.

The postproc workers encode them for requests with `OutputOptions.kind == "anthropic"`; the
frontend relays the bytes. Field names follow the `anthropic` SDK's types (`Message`, `Usage`,
`RawMessageStreamEvent`). A stream is, in order (a ping after the first block's start):

    message_start ─ (content_block_start ─ content_block_delta* ─ content_block_stop)+
    ─ message_delta (stop_reason, cumulative usage) ─ message_stop

each framed as `event: <type>\\ndata: <json>\\n\\n`, with no `[DONE]` at the end.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

StopReason = Literal[
    "end_turn",
    "max_tokens",
    "stop_sequence",
    "tool_use",
    "pause_turn",
    "refusal",
    "model_context_window_exceeded",
]


class Usage(msgspec.Struct, kw_only=True):
    """Anthropic counts the prompt in parts: input_tokens + cache_read_input_tokens is all of it."""

    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0


class TextBlock(msgspec.Struct, tag_field="type", tag="text", kw_only=True):
    text: str


class ThinkingBlock(msgspec.Struct, tag_field="type", tag="thinking", kw_only=True):
    """The model's reasoning; `signature` stays empty (nothing here signs thinking)."""

    thinking: str
    signature: str = ""


class ToolUseBlock(msgspec.Struct, tag_field="type", tag="tool_use", kw_only=True):
    id: str
    name: str
    input: dict[str, Any]  # the call's arguments; {} while streaming (see InputJsonDelta)


ContentBlock = TextBlock | ThinkingBlock | ToolUseBlock


class Message(msgspec.Struct, tag_field="type", tag="message", kw_only=True):
    """The non-streaming body, and (with empty content, no stop_reason) message_start's skeleton."""

    id: str
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentBlock]
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None  # the stop string that ended the text, when one did
    usage: Usage


# --- stream events --------------------------------------------------------------------------------


class _Event(msgspec.Struct, tag_field="type", kw_only=True):
    pass


class MessageStart(_Event, tag="message_start"):
    message: Message


class ContentBlockStart(_Event, tag="content_block_start"):
    index: int
    content_block: ContentBlock


class Ping(_Event, tag="ping"):
    pass


class TextDelta(msgspec.Struct, tag_field="type", tag="text_delta", kw_only=True):
    text: str


class ThinkingDelta(msgspec.Struct, tag_field="type", tag="thinking_delta", kw_only=True):
    thinking: str


class InputJsonDelta(msgspec.Struct, tag_field="type", tag="input_json_delta", kw_only=True):
    """The next piece of a tool_use block's input, as JSON text."""

    partial_json: str


class ContentBlockDelta(_Event, tag="content_block_delta"):
    index: int
    delta: TextDelta | ThinkingDelta | InputJsonDelta


class ContentBlockStop(_Event, tag="content_block_stop"):
    index: int


class MessageDeltaBody(msgspec.Struct, kw_only=True):
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None


class MessageDelta(_Event, tag="message_delta"):
    """The last word on the message: why it stopped, and usage as cumulative totals."""

    delta: MessageDeltaBody
    usage: Usage


class MessageStop(_Event, tag="message_stop"):
    pass


StreamEvent = (
    MessageStart
    | ContentBlockStart
    | Ping
    | ContentBlockDelta
    | ContentBlockStop
    | MessageDelta
    | MessageStop
)


# --- errors ---------------------------------------------------------------------------------------


class ErrorDetail(msgspec.Struct, kw_only=True):
    type: str  # invalid_request_error, not_found_error, overloaded_error, api_error, ...
    message: str


class ErrorResponse(msgspec.Struct, tag_field="type", tag="error", kw_only=True):
    """An error body, and (as `event: error`) an error in the middle of a stream."""

    error: ErrorDetail
