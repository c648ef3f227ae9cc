"""OpenAI Responses bytes for one request: the Response object, or its stream of events.

As for Anthropic (anthropic_format.py), `RequestState` (formatter.py) detokenizes, applies stop
strings and runs the reasoning / tool parsers; a `ResponsesRenderer` only shapes what came out
(`ParsedText`) into output items, in output order:

    reasoning (rs_...) ─ message (msg_..., one output_text part) ─ function_call (fc_...) ...

Streamed, each item is announced (output_item.added), filled (content_part.added, then
output_text / reasoning_text / function_call_arguments deltas) and closed (... .done) before the
next opens; the stream opens with response.created and response.in_progress and ends with
response.completed (or response.incomplete at max_output_tokens), every event numbered in
order (sequence_number).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import msgspec

from common.responses_schema import (
    ContentPartAdded,
    ContentPartDone,
    FunctionCallArgumentsDelta,
    FunctionCallArgumentsDone,
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    MessageItem,
    OutputItem,
    OutputItemAdded,
    OutputItemDone,
    OutputText,
    OutputTextDelta,
    OutputTextDone,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    ReasoningTextDelta,
    ReasoningTextDone,
    Response,
    ResponseCompleted,
    ResponseCreated,
    ResponseIncomplete,
    ResponseInProgress,
    ResponseSettings,
    ResponseUsage,
    StreamEvent,
)
from postproc_worker.parsers import ParsedText, ToolCallStart

_json = msgspec.json.Encoder()


def usage(num_prompt_tokens: int, num_cached_tokens: int, num_output_tokens: int) -> ResponseUsage:
    return ResponseUsage(
        input_tokens=num_prompt_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=num_cached_tokens),
        output_tokens=num_output_tokens,
        output_tokens_details=OutputTokensDetails(),
        total_tokens=num_prompt_tokens + num_output_tokens,
    )


def _item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


@dataclass(slots=True)
class _OpenItem:
    """The item being streamed: which kind, which tool call, its text so far."""

    key: tuple[str, int]  # (reasoning | message | function_call, tool call index or -1)
    item: OutputItem
    text: list[str] = field(default_factory=list)


class ResponsesRenderer:
    """The bytes of one Response, streamed or not."""

    usage = staticmethod(usage)

    def __init__(
        self, response_id: str, model: str, created_at: int, settings: ResponseSettings
    ) -> None:
        self.skeleton = Response(
            **msgspec.structs.asdict(settings),
            id=response_id,
            model=model,
            created_at=created_at,
            status="in_progress",
        )
        self.started = False
        self.output: list[OutputItem] = []  # closed items, in order
        self._open: _OpenItem | None = None
        self._sequence = 0

    # --- streaming --------------------------------------------------------------------------------

    def stream_frames(self, parsed: ParsedText, usage: ResponseUsage) -> bytes:
        """Events for newly parsed output; the first call opens the response."""
        frames = self._start()
        if parsed.reasoning:
            frames += self._ensure_open(("reasoning", -1))
            frames += self._text_delta(parsed.reasoning)
        for event in parsed.events:
            if isinstance(event, str):
                if event:
                    frames += self._ensure_open(("message", -1))
                    frames += self._text_delta(event)
            elif isinstance(event, ToolCallStart):
                frames += self._ensure_open(("function_call", event.index), event)
            elif event.text:
                frames += self._text_delta(event.text)
        return frames

    def end_frames(
        self,
        finish_reason: str | None,
        stop_sequence: str | None,
        called_tools: bool,
        usage: ResponseUsage,
    ) -> bytes:
        """Close the open item and the response (completed, or incomplete at the token limit);
        the Responses API says neither which stop string nor that tools were called."""
        frames = self._start() + self._close()
        response = self._final(list(self.output), finish_reason, usage)
        done = (
            ResponseIncomplete(response=response)
            if response.status == "incomplete"
            else ResponseCompleted(response=response)
        )
        return frames + self._event(done)

    def _start(self) -> bytes:
        if self.started:
            return b""
        self.started = True
        return self._event(ResponseCreated(response=self.skeleton)) + self._event(
            ResponseInProgress(response=self.skeleton)
        )

    def _ensure_open(self, key: tuple[str, int], call: ToolCallStart | None = None) -> bytes:
        if self._open is not None and self._open.key == key:
            return b""
        frames = self._close()
        kind = key[0]
        if kind == "reasoning":
            item: OutputItem = ReasoningItem(id=_item_id("rs"), status="in_progress")
        elif kind == "message":
            item = MessageItem(id=_item_id("msg"), status="in_progress")
        else:
            assert call is not None
            item = FunctionCallItem(
                id=_item_id("fc"), call_id=call.id, name=call.name, arguments="",
                status="in_progress",
            )  # fmt: skip
        self._open = _OpenItem(key, item)
        index = len(self.output)
        frames += self._event(OutputItemAdded(output_index=index, item=item))
        if kind != "function_call":
            frames += self._event(
                ContentPartAdded(item_id=item.id, output_index=index, content_index=0,
                                 part=self._part(kind, ""))
            )  # fmt: skip
        return frames

    def _text_delta(self, text: str) -> bytes:
        assert self._open is not None
        self._open.text.append(text)
        item_id, index = self._open.item.id, len(self.output)
        kind = self._open.key[0]
        if kind == "reasoning":
            delta: StreamEvent = ReasoningTextDelta(
                item_id=item_id, output_index=index, content_index=0, delta=text
            )
        elif kind == "message":
            delta = OutputTextDelta(
                item_id=item_id, output_index=index, content_index=0, delta=text
            )
        else:
            delta = FunctionCallArgumentsDelta(item_id=item_id, output_index=index, delta=text)
        return self._event(delta)

    def _close(self) -> bytes:
        if self._open is None:
            return b""
        opened, self._open = self._open, None
        kind, text, index = opened.key[0], "".join(opened.text), len(self.output)
        item = _finished(opened.item, text)
        frames = b""
        if kind == "reasoning":
            frames += self._event(
                ReasoningTextDone(item_id=item.id, output_index=index, content_index=0, text=text)
            )
        elif kind == "message":
            frames += self._event(
                OutputTextDone(item_id=item.id, output_index=index, content_index=0, text=text)
            )
        else:
            assert isinstance(item, FunctionCallItem)
            frames += self._event(
                FunctionCallArgumentsDone(item_id=item.id, output_index=index, name=item.name,
                                          arguments=text)
            )  # fmt: skip
        if kind != "function_call":
            frames += self._event(
                ContentPartDone(item_id=item.id, output_index=index, content_index=0,
                                part=self._part(kind, text))
            )  # fmt: skip
        self.output.append(item)
        return frames + self._event(OutputItemDone(output_index=index, item=item))

    @staticmethod
    def _part(kind: str, text: str) -> OutputText | ReasoningText:
        return ReasoningText(text=text) if kind == "reasoning" else OutputText(text=text)

    def _event(self, event: StreamEvent) -> bytes:
        event.sequence_number = self._sequence
        self._sequence += 1
        tag = event.__struct_config__.tag
        return f"event: {tag}\ndata: ".encode() + _json.encode(event) + b"\n\n"

    # --- the whole response -----------------------------------------------------------------------

    def body(
        self,
        parsed: ParsedText,
        finish_reason: str | None,
        stop_sequence: str | None,
        called_tools: bool,
        usage: ResponseUsage,
    ) -> bytes:
        return _json.encode(self._final(output_items(parsed), finish_reason, usage))

    def _final(
        self, output: list[OutputItem], finish_reason: str | None, usage: ResponseUsage
    ) -> Response:
        incomplete = finish_reason == "length"
        return msgspec.structs.replace(
            self.skeleton,
            status="incomplete" if incomplete else "completed",
            incomplete_details=IncompleteDetails(reason="max_output_tokens")
            if incomplete
            else None,
            output=output,
            usage=usage,
        )


def _finished(item: OutputItem, text: str) -> OutputItem:
    if isinstance(item, ReasoningItem):
        return msgspec.structs.replace(item, content=[ReasoningText(text=text)], status="completed")
    if isinstance(item, MessageItem):
        return msgspec.structs.replace(item, content=[OutputText(text=text)], status="completed")
    return msgspec.structs.replace(item, arguments=text, status="completed")


def output_items(parsed: ParsedText) -> list[OutputItem]:
    """The non-streamed output: reasoning, then text and calls in the order they came."""
    items: list[OutputItem] = []
    if parsed.reasoning:
        items.append(
            ReasoningItem(id=_item_id("rs"), content=[ReasoningText(text=parsed.reasoning)])
        )
    calls: dict[int, tuple[int, list[str]]] = {}  # call index -> (item position, argument pieces)
    for event in parsed.events:
        if isinstance(event, str):
            last = items[-1] if items else None
            if event and isinstance(last, MessageItem):
                last.content[0].text += event
            elif event:
                items.append(MessageItem(id=_item_id("msg"), content=[OutputText(text=event)]))
        elif isinstance(event, ToolCallStart):
            calls[event.index] = (len(items), [])
            items.append(FunctionCallItem(id=_item_id("fc"), call_id=event.id, name=event.name,
                                          arguments=""))  # fmt: skip
        else:
            calls[event.index][1].append(event.text)
    for position, pieces in calls.values():
        item = items[position]
        assert isinstance(item, FunctionCallItem)
        item.arguments = "".join(pieces)
    return items
