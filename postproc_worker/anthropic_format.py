"""Anthropic Messages bytes for one request: the Message body, or its stream of SSE events.

`RequestState` (formatter.py) detokenizes and applies stop strings for every kind; for kind
"anthropic" it hands the visible text and the way the choice ended to an `AnthropicRenderer`,
which only shapes the bytes. The API has no n and no logprobs (the frontend refuses both), so a
message is one choice and one text block, at index 0.
"""

from __future__ import annotations

import msgspec

from common.anthropic_schema import (
    ContentBlockDelta,
    ContentBlockStart,
    ContentBlockStop,
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
    Usage,
)

TEXT_BLOCK_INDEX = 0

_json = msgspec.json.Encoder()


def stop_reason(finish_reason: str | None, stop_sequence: str | None) -> StopReason:
    """A stop string: stop_sequence; the token limit: max_tokens; EOS or a stop token: end_turn
    (and so is an abort: nobody reads that answer)."""
    if stop_sequence is not None:
        return "stop_sequence"
    if finish_reason == "length":
        return "max_tokens"
    return "end_turn"


def usage(num_prompt_tokens: int, num_cached_tokens: int, num_output_tokens: int) -> Usage:
    """Anthropic's input_tokens leaves out the prompt tokens read from the cache."""
    return Usage(
        input_tokens=num_prompt_tokens - num_cached_tokens,
        output_tokens=num_output_tokens,
        cache_read_input_tokens=num_cached_tokens,
    )


class AnthropicRenderer:
    """The bytes of one Message, streamed or not; remembers whether message_start went out."""

    def __init__(self, message_id: str, model: str) -> None:
        self.message_id = message_id
        self.model = model
        self.started = False

    def stream_frames(self, text: str, usage: Usage) -> bytes:
        """Frames for newly visible text; the first call opens the message and its text block."""
        frames = b""
        if not self.started:
            self.started = True
            skeleton = Message(id=self.message_id, model=self.model, content=[], usage=usage)
            frames += _sse(MessageStart(message=skeleton))
            frames += _sse(
                ContentBlockStart(index=TEXT_BLOCK_INDEX, content_block=TextBlock(text=""))
            )
            frames += _sse(Ping())
        if text:
            frames += _sse(ContentBlockDelta(index=TEXT_BLOCK_INDEX, delta=TextDelta(text=text)))
        return frames

    def end_frames(
        self, finish_reason: str | None, stop_sequence: str | None, usage: Usage
    ) -> bytes:
        """Close the text block and the message; `usage` holds the final, cumulative counts."""
        delta = MessageDeltaBody(
            stop_reason=stop_reason(finish_reason, stop_sequence), stop_sequence=stop_sequence
        )
        return (
            _sse(ContentBlockStop(index=TEXT_BLOCK_INDEX))
            + _sse(MessageDelta(delta=delta, usage=usage))
            + _sse(MessageStop())
        )

    def body(
        self, text: str, finish_reason: str | None, stop_sequence: str | None, usage: Usage
    ) -> bytes:
        """The non-streaming Message: always one text block, even an empty one."""
        return _json.encode(
            Message(
                id=self.message_id,
                model=self.model,
                content=[TextBlock(text=text)],
                stop_reason=stop_reason(finish_reason, stop_sequence),
                stop_sequence=stop_sequence,
                usage=usage,
            )
        )


def _sse(event: StreamEvent) -> bytes:
    """Anthropic names each SSE event after its type, and sends no `[DONE]`."""
    return f"event: {event.__struct_config__.tag}\ndata: ".encode() + _json.encode(event) + b"\n\n"
