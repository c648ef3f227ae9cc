"""Anthropic Messages bytes for one request: the Message body, or its stream of SSE events.

`RequestState` (formatter.py) detokenizes, applies stop strings and runs the reasoning / tool
parsers for every kind; for kind "anthropic" it hands what came out (`ParsedText`: reasoning,
then content text and tool-call events in output order) and the way the choice ended to an
`AnthropicRenderer`, which only shapes the bytes. The API has no n and no logprobs (the frontend
refuses both), so a message is one choice. Its content blocks, in output order:

    thinking (the reasoning) ─ text ─ tool_use ─ tool_use ─ text ...

A tool_use block streams its input as `input_json_delta` pieces of JSON text; in the body it is
the decoded object ({} when the output ended inside the call: stop_reason says max_tokens).
"""

from __future__ import annotations

from typing import Any

import msgspec

from common.anthropic_schema import (
    ContentBlock,
    ContentBlockDelta,
    ContentBlockStart,
    ContentBlockStop,
    InputJsonDelta,
    Message,
    MessageDelta,
    MessageDeltaBody,
    MessageStart,
    MessageStop,
    Ping,
    StopReason,
    StreamEvent,
    TextBlock,
    TextDelta,
    ThinkingBlock,
    ThinkingDelta,
    ToolUseBlock,
    Usage,
)
from postproc_worker.parsers import ParsedText, ToolCallStart

_json = msgspec.json.Encoder()


def stop_reason(
    finish_reason: str | None, stop_sequence: str | None, called_tools: bool
) -> StopReason:
    """A stop string: stop_sequence; the token limit: max_tokens; a finished tool call: tool_use;
    EOS or a stop token: end_turn (and so is an abort: nobody reads that answer)."""
    if stop_sequence is not None:
        return "stop_sequence"
    if finish_reason == "length":
        return "max_tokens"
    return "tool_use" if called_tools else "end_turn"


def usage(num_prompt_tokens: int, num_cached_tokens: int, num_output_tokens: int) -> Usage:
    """Anthropic's input_tokens leaves out the prompt tokens read from the cache."""
    return Usage(
        input_tokens=num_prompt_tokens - num_cached_tokens,
        output_tokens=num_output_tokens,
        cache_read_input_tokens=num_cached_tokens,
    )


class AnthropicRenderer:
    """The bytes of one Message, streamed or not. Streaming, it keeps which block is open: a
    block closes when output of another kind (or another tool call) begins."""

    usage = staticmethod(usage)

    def __init__(self, message_id: str, model: str) -> None:
        self.message_id = message_id
        self.model = model
        self.started = False
        self._open: tuple[str, int] | None = None  # (block type, tool call index) being streamed
        self._num_blocks = 0

    def stream_frames(self, parsed: ParsedText, usage: Usage) -> bytes:
        """Frames for newly parsed output; the first call opens the message."""
        frames = self._start(usage)
        if parsed.reasoning:
            frames += self._block(("thinking", -1), ThinkingBlock(thinking=""))
            frames += self._delta(ThinkingDelta(thinking=parsed.reasoning))
        for event in parsed.events:
            if isinstance(event, str):
                if event:
                    frames += self._block(("text", -1), TextBlock(text=""))
                    frames += self._delta(TextDelta(text=event))
            elif isinstance(event, ToolCallStart):
                block = ToolUseBlock(id=tool_use_id(event.id), name=event.name, input={})
                frames += self._block(("tool_use", event.index), block)
            elif event.text:
                frames += self._delta(InputJsonDelta(partial_json=event.text))
        return frames

    def end_frames(
        self, finish_reason: str | None, stop_sequence: str | None, called_tools: bool, usage: Usage
    ) -> bytes:
        """Close the open block and the message; `usage` holds the final, cumulative counts. An
        answer with no output at all is one empty text block, as in the body."""
        frames = self._start(usage)
        if not self._num_blocks:
            frames += self._block(("text", -1), TextBlock(text=""))
        delta = MessageDeltaBody(
            stop_reason=stop_reason(finish_reason, stop_sequence, called_tools),
            stop_sequence=stop_sequence,
        )
        return (
            frames
            + self._close()
            + _sse(MessageDelta(delta=delta, usage=usage))
            + _sse(MessageStop())
        )

    def body(
        self,
        parsed: ParsedText,
        finish_reason: str | None,
        stop_sequence: str | None,
        called_tools: bool,
        usage: Usage,
    ) -> bytes:
        """The non-streaming Message: its blocks in output order, at least one (text)."""
        return _json.encode(
            Message(
                id=self.message_id,
                model=self.model,
                content=content_blocks(parsed),
                stop_reason=stop_reason(finish_reason, stop_sequence, called_tools),
                stop_sequence=stop_sequence,
                usage=usage,
            )
        )

    def _start(self, usage: Usage) -> bytes:
        if self.started:
            return b""
        self.started = True
        skeleton = Message(id=self.message_id, model=self.model, content=[], usage=usage)
        return _sse(MessageStart(message=skeleton))

    def _block(self, key: tuple[str, int], block: ContentBlock) -> bytes:
        """Open the block for `key` unless it is the one open now."""
        if self._open == key:
            return b""
        frames = self._close()
        self._open = key
        self._num_blocks += 1
        frames += _sse(ContentBlockStart(index=self._num_blocks - 1, content_block=block))
        return frames + _sse(Ping()) if self._num_blocks == 1 else frames  # as Anthropic does

    def _delta(self, delta: TextDelta | ThinkingDelta | InputJsonDelta) -> bytes:
        return _sse(ContentBlockDelta(index=self._num_blocks - 1, delta=delta))

    def _close(self) -> bytes:
        if self._open is None:
            return b""
        self._open = None
        return _sse(ContentBlockStop(index=self._num_blocks - 1))


def content_blocks(parsed: ParsedText) -> list[ContentBlock]:
    blocks: list[ContentBlock] = []
    if parsed.reasoning:
        blocks.append(ThinkingBlock(thinking=parsed.reasoning))
    calls: dict[int, tuple[ToolUseBlock, list[str]]] = {}
    for event in parsed.events:
        if isinstance(event, str):
            if event and blocks and isinstance(blocks[-1], TextBlock):
                blocks[-1].text += event
            elif event:
                blocks.append(TextBlock(text=event))
        elif isinstance(event, ToolCallStart):
            block = ToolUseBlock(id=tool_use_id(event.id), name=event.name, input={})
            calls[event.index] = (block, [])
            blocks.append(block)
        else:
            calls[event.index][1].append(event.text)
    for block, pieces in calls.values():
        block.input = _json_object("".join(pieces))
    return blocks or [TextBlock(text="")]


def _json_object(text: str) -> dict[str, Any]:
    """The arguments as an object; {} when they are cut short (or not an object)."""
    try:
        value = msgspec.json.decode(text)
    except msgspec.DecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _sse(event: StreamEvent) -> bytes:
    """Anthropic names each SSE event after its type, and sends no `[DONE]`."""
    return f"event: {event.__struct_config__.tag}\ndata: ".encode() + _json.encode(event) + b"\n\n"


def tool_use_id(call_id: str) -> str:
    """Anthropic's id style for a parsed call ("call_ab12..." -> "toolu_ab12...")."""
    return "toolu_" + call_id.removeprefix("call_")
