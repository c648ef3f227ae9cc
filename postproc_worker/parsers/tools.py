"""Tool-call parsers: a chat choice's content split into content text and tool calls, as it streams.

Each parser is a small state machine over the text not yet consumed. `feed(text)` returns events
in output order: `str` (content), `ToolCallStart` (index, id, name), `ToolCallArguments` (the
next piece of that call's arguments). `finish()` releases what was held at the end of the output.
The non-streaming path feeds the whole text once, so both paths give the same result.

Rules shared by every format:
- markers never reach the content; a stray one (an end marker with no call open) is dropped.
- whitespace next to a call (the "\\n" between `</tool_call>` and `<tool_call>`) is dropped;
  the trailing whitespace of content is held until it is known whether a call follows.
- a call starts (and is counted) once its name is known and its arguments begin; the arguments
  are streamed as the model writes them (json_stream.py).
- the output ended inside a call: a call that started stays one, its arguments cut where the
  output ended (like OpenAI's on finish_reason "length"); a call that never started (no name
  yet, or not a call: malformed JSON) becomes content, without its markers.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from functools import cache
from typing import ClassVar

from common.parser_choice import ToolParserName
from postproc_worker.parsers.json_stream import CallObject, JsonValue
from postproc_worker.parsers.markers import Markers


@dataclass(frozen=True, slots=True)
class ToolCallStart:
    index: int  # 0, 1, ... in the order the calls appear in this choice
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class ToolCallArguments:
    index: int
    text: str  # the next piece of the arguments' JSON text


ToolEvent = str | ToolCallStart | ToolCallArguments


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


@cache
def _markers(texts: tuple[str, ...]) -> Markers:
    return Markers(texts)


class ToolParser:
    """Base: content handling, call bookkeeping, and the JSON call objects most formats use.

    Subclasses name their `markers`, their `begin` string (with `in_tool_call`, the prompt ended
    with it: a forced call), and implement `_first_state` and `_step` (consume from `self._buf`;
    True if it made progress and the loop should go on).
    """

    markers: ClassVar[tuple[str, ...]] = ()
    begin: ClassVar[str] = ""
    arguments_keys: ClassVar[frozenset[str]] = frozenset({"arguments"})

    def __init__(self, *, in_tool_call: bool = False) -> None:
        self.num_calls = 0
        self._buf = ""
        self._final = False
        self._events: list[ToolEvent] = []
        self._marker_set = _markers(self.markers)
        self._call_open = False  # a ToolCallStart went out and the call has not ended
        self._held_ws = ""  # trailing whitespace of the content
        self._after_call = False  # drop whitespace until the next content
        self._object: CallObject | None = None
        self._needs_arguments = False  # an object without arguments is content, not a call
        self._state = self._first_state(in_tool_call)

    def feed(self, text: str) -> list[ToolEvent]:
        self._buf += text
        while self._buf and self._step():
            pass
        return self._take_events()

    def finish(self) -> list[ToolEvent]:
        self._final = True
        while self._buf and self._step():
            pass
        if self._object is not None:
            self._end_object()
        if self._call_open:
            self._end_call()
        self._emit_content(self._marker_set.remove(self._buf))
        self._buf = ""
        if self._held_ws:
            self._events.append(self._held_ws)
            self._held_ws = ""
        return self._take_events()

    def _first_state(self, in_tool_call: bool) -> str:
        raise NotImplementedError

    def _step(self) -> bool:
        raise NotImplementedError

    def _take_events(self) -> list[ToolEvent]:
        events, self._events = self._events, []
        return events

    # --- content ----------------------------------------------------------------------------------

    def _emit_content(self, text: str) -> None:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        text = self._held_ws + text
        body = text.rstrip()
        self._held_ws = text[len(body) :]
        if body:
            self._events.append(body)

    def _content_until_marker(self) -> str | None:
        """Emit content up to the next marker and consume it; None: no whole marker yet."""
        found = self._marker_set.find(self._buf)
        if found is None:
            split = len(self._buf) - (0 if self._final else self._marker_set.held_len(self._buf))
            self._emit_content(self._buf[:split])
            self._buf = self._buf[split:]
            return None
        pos, marker = found
        self._emit_content(self._buf[:pos])
        self._buf = self._buf[pos + len(marker) :]
        return marker

    def _expect(self, literal: str) -> bool | None:
        """Skip whitespace, then consume `literal` if it is next; None: cannot tell yet."""
        self._buf = self._buf.lstrip()
        if self._buf.startswith(literal):
            self._buf = self._buf[len(literal) :]
            return True
        if literal.startswith(self._buf) and not self._final:
            return None
        return False

    # --- calls ------------------------------------------------------------------------------------

    def _start_call(self, name: str) -> None:
        self._held_ws = ""
        self._events.append(ToolCallStart(self.num_calls, new_call_id(), name))
        self.num_calls += 1
        self._call_open = True

    def _add_arguments(self, text: str) -> None:
        if text:
            self._events.append(ToolCallArguments(self.num_calls - 1, text))

    def _end_call(self) -> None:
        self._call_open = False
        self._after_call = True

    def _begin_object(
        self, allowed_keys: frozenset[str] | None = None, needs_arguments: bool = False
    ) -> None:
        self._object = CallObject(self.arguments_keys, allowed_keys)
        self._needs_arguments = needs_arguments

    def _feed_object(self) -> bool | None:
        """Feed the open call object; None while it goes on, then whether it was a call."""
        obj = self._object
        assert obj is not None
        used = obj.feed(self._buf)
        self._buf = self._buf[used:]
        if not self._call_open and obj.name is not None and obj.arguments_started:
            self._start_call(obj.name)
        if self._call_open:
            self._add_arguments(obj.take_arguments())
        if not (obj.done or obj.failed or self._final):
            return None
        return self._end_object()

    def _end_object(self) -> bool:
        obj = self._object
        assert obj is not None
        self._object = None
        if not self._call_open and obj.done and obj.name is not None:
            if self._needs_arguments:
                self._emit_content(obj.raw)
                return False
            self._start_call(obj.name)
            self._add_arguments("{}")
        if not self._call_open:
            self._emit_content(obj.raw)  # not a call after all
            return False
        self._end_call()
        return True


class HermesToolParser(ToolParser):
    """Hermes, Qwen2.5, Qwen3: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`."""

    markers = ("<tool_call>", "</tool_call>")
    begin = "<tool_call>\n"

    def _first_state(self, in_tool_call: bool) -> str:
        if in_tool_call:
            self._begin_object()
            return "call"
        return "content"

    def _step(self) -> bool:
        if self._state == "content":
            marker = self._content_until_marker()
            if marker is None:
                return False
            if marker == "<tool_call>":  # a stray </tool_call> is just dropped
                self._begin_object()
                self._state = "call"
            return True
        if self._state == "call":
            was_call = self._feed_object()
            if was_call is None:
                return False
            self._state = "close" if was_call else "content"
            return True
        closed = self._expect("</tool_call>")  # without it, what follows is content
        if closed is None:
            return False
        self._state = "content"
        return True


class Llama3JsonToolParser(ToolParser):
    """Llama 3.x JSON calls: the output is `{"name": ..., "parameters": {...}}` (or follows
    `<|python_tag|>`), several separated by `;`. A bare JSON object that has no arguments or
    has other keys is an answer in JSON, so it is content."""

    markers = ("<|python_tag|>",)
    begin = "<|python_tag|>"
    arguments_keys = frozenset({"parameters", "arguments"})
    _KEYS = frozenset({"name", "parameters", "arguments", "type"})

    def _first_state(self, in_tool_call: bool) -> str:
        if in_tool_call:
            self._begin_object(self._KEYS)
            return "call"
        return "start"

    def _step(self) -> bool:
        if self._state == "start":  # only a JSON object at the very start is a bare call
            head = self._buf.lstrip()
            if not head and not self._final:
                return False
            if head.startswith("{"):
                self._buf = head
                self._begin_object(self._KEYS, needs_arguments=True)
                self._state = "call"
            else:
                self._state = "content"
            return True
        if self._state == "content":
            if self._content_until_marker() is None:
                return False
            self._begin_object(self._KEYS)
            self._state = "call"
            return True
        if self._state == "call":
            was_call = self._feed_object()
            if was_call is None:
                return False
            self._state = "next" if was_call else "content"
            return True
        more = self._expect(";")
        if more is None:
            return False
        if more:
            self._begin_object(self._KEYS)
            self._state = "call"
        else:
            self._state = "content"
        return True


class MistralToolParser(ToolParser):
    """Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`."""

    markers = ("[TOOL_CALLS]",)
    begin = "[TOOL_CALLS]"

    def _first_state(self, in_tool_call: bool) -> str:
        return "open" if in_tool_call else "content"

    def _step(self) -> bool:
        if self._state == "content":
            if self._content_until_marker() is None:
                return False
            self._state = "open"
            return True
        if self._state == "open":
            opened = self._expect("[")
            if opened is None:
                return False
            self._state = "item" if opened else "content"
            return True
        if self._state == "item":
            self._buf = self._buf.lstrip()
            if not self._buf:
                return False
            if self._buf[0] in ",]":
                self._state = "item" if self._buf[0] == "," else "content"
                self._buf = self._buf[1:]
            else:
                self._begin_object()
                self._state = "call"
            return True
        was_call = self._feed_object()
        if was_call is None:
            return False
        self._state = "item" if was_call else "content"
        return True


_DEEPSEEK_HEADER = re.compile(r"\s*[^\n]*?<｜tool▁sep｜>([^\n]*)\n")


class DeepSeekV3ToolParser(ToolParser):
    """DeepSeek-V3: `<｜tool▁calls▁begin｜>`, then per call `<｜tool▁call▁begin｜>function
    <｜tool▁sep｜>NAME\\n```json\\n{ARGS}\\n```<｜tool▁call▁end｜>` (no line break after
    "function"), then `<｜tool▁calls▁end｜>`."""

    CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
    CALLS_END = "<｜tool▁calls▁end｜>"
    CALL_BEGIN = "<｜tool▁call▁begin｜>"
    CALL_END = "<｜tool▁call▁end｜>"
    markers = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, "<｜tool▁sep｜>")
    begin = CALLS_BEGIN

    def __init__(self, *, in_tool_call: bool = False) -> None:
        super().__init__(in_tool_call=in_tool_call)
        self._arguments = JsonValue()

    def _first_state(self, in_tool_call: bool) -> str:
        return "calls" if in_tool_call else "content"

    def _step(self) -> bool:
        state = self._state
        if state == "content":
            marker = self._content_until_marker()
            if marker is None:
                return False
            if marker in (self.CALLS_BEGIN, self.CALL_BEGIN):  # other markers: stray, dropped
                self._state = "calls" if marker == self.CALLS_BEGIN else "header"
            return True
        if state == "calls":
            return self._step_calls()
        if state == "header":
            match = _DEEPSEEK_HEADER.match(self._buf)
            if match is None:
                return False  # held until whole; at the end of the output it becomes content
            self._buf = self._buf[match.end() :]
            self._start_call(match.group(1).strip())
            self._state = "fence"
            return True
        if state == "fence":
            return self._step_fence()
        if state == "arguments":
            return self._step_arguments()
        self._buf = self._buf.lstrip()  # "tail": the closing fence, then the call's end marker
        if "```".startswith(self._buf) and not self._final:
            return False
        if self._buf.startswith("```"):
            self._buf = self._buf[3:]
        ended = self._expect(self.CALL_END)
        if ended is None:
            return False
        self._state = "calls"
        return True

    def _step_calls(self) -> bool:
        for marker, state in ((self.CALL_BEGIN, "header"), (self.CALLS_END, "content")):
            found = self._expect(marker)
            if found is None:
                return False
            if found:
                self._state = state
                return True
        self._state = "content"  # no end marker: what follows is content
        return True

    def _step_fence(self) -> bool:
        self._buf = self._buf.lstrip()
        if not self._buf or ("```json".startswith(self._buf) and not self._final):
            return False
        for fence in ("```json", "```"):
            if self._buf.startswith(fence):
                self._buf = self._buf[len(fence) :]
                break
        self._arguments = JsonValue()
        self._state = "arguments"
        return True

    def _step_arguments(self) -> bool:
        if not self._arguments.first:
            self._buf = self._buf.lstrip()
        end = self._arguments.feed(self._buf)
        self._add_arguments(self._buf[:end])
        self._buf = self._buf[end:]
        if not self._arguments.done:
            return False
        self._end_call()
        self._state = "tail"
        return True


# "harmony": parsers/harmony.py adds its parser (a ToolParser that also keeps the reasoning)
# when imported; pipeline.py imports it, and so the package's __init__ (pipeline builds a
# harmony model's parser itself: the entry is for those that look parsers up by name).
TOOL_PARSERS: dict[ToolParserName, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "qwen3": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "deepseek_v3": DeepSeekV3ToolParser,
}
