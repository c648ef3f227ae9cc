"""Harmony output (gpt-oss) split as it streams: reasoning, content and tool calls by channel.

The output starts right after the prompt's `<|start|>assistant`, so with a header. Each message
is `{header}<|message|>{body}` and ends at `<|end|>` (another `<|start|>assistant` header
follows), or at `<|return|>` / `<|call|>` (the stop tokens; the postproc worker drops the one
that stopped the engine, so the output may just end):

    <|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...
    <|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>commentary
        to=functions.get_weather <|constrain|>json<|message|>{"location":"Tokyo"}<|call|>

A message goes by its header, as vLLM maps it (entrypoints/openai harmony streaming):

    channel analysis, no recipient        → reasoning
    recipient functions.NAME (any channel)→ a tool call NAME, the body its arguments as written
                                            (`<|constrain|>json` optional), streamed; with no
                                            tool parsing asked for (no tools), content
    other recipients (built-in tools)     → reasoning: not an answer the client can act on
    final, commentary without recipient   → content (commentary: a preamble to calls, shown
                                            to the user as vLLM shows it)
    unknown or missing channel            → content

Messages of one kind in a row are joined with "\\n" (vLLM joins them so). Malformed output never
fails: a header ended by anything but `<|message|>` becomes content (its markers removed); a
header cut by the end of the output is dropped when it follows `<|start|>` (a role, say
`assistant` cut by max_tokens) or holds `<|channel|>` or a recipient (it was metadata), else it
is content (a model not writing harmony at all); a stray `<|channel|>`,
`<|message|>` or `<|constrain|>` in a body is dropped; a message cut by the end of the output
keeps what it had (a call with its arguments so far, `{}` when it had none). The markers never
reach the client; other special tokens are removed before this parser (pipeline.py).
"""

from __future__ import annotations

import re

from common.harmony import (
    CALL,
    CHANNEL,
    CONSTRAIN,
    END,
    FUNCTION_RECIPIENT_PREFIX,
    MARKERS,
    MESSAGE,
    RETURN,
    START,
)
from postproc_worker.parsers.tools import TOOL_PARSERS, ToolEvent, ToolParser

_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"([^\s<]*)")
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_ENDS = (END, CALL, RETURN, START)


def header_kind(header: str, parse_tools: bool) -> tuple[str, str]:
    """What a message with this header (the text before `<|message|>`) is: ("reasoning" |
    "content" | "call", the function's name for a call)."""
    channel = _CHANNEL_NAME.search(header)
    recipient = _RECIPIENT.search(header)
    if recipient is not None:
        target = recipient.group(1)
        name = target.removeprefix(FUNCTION_RECIPIENT_PREFIX)
        if target.startswith(FUNCTION_RECIPIENT_PREFIX) and name:
            return ("call", name) if parse_tools else ("content", "")
        return "reasoning", ""
    if channel is not None and channel.group(1) == "analysis":
        return "reasoning", ""
    return "content", ""


class HarmonyParser(ToolParser):
    """One choice's harmony output; `feed` / `finish` return content and call events (the
    ToolParser contract) and keep the reasoning for `take_reasoning`."""

    markers = MARKERS

    def __init__(self, *, in_tool_call: bool = False, parse_tools: bool = True) -> None:
        self._parse_tools = parse_tools
        self._header = ""  # the current header so far (markers inside it kept)
        self._kind = ""  # the open message's kind; "" while in a header
        self._reasoning: list[str] = []
        self._wrote: set[str] = set()  # kinds that have text already: the next gets a "\n"
        self._separator = ""
        self._call_arguments = False  # the open call had argument text
        self._started = False  # the header being read follows <|start|>: a message's role
        super().__init__(in_tool_call=in_tool_call)

    def take_reasoning(self) -> str:
        text = "".join(self._reasoning)
        self._reasoning.clear()
        return text

    def _first_state(self, in_tool_call: bool) -> str:
        return "header"  # a forced call is by grammar alone: the output still starts a header

    def finish(self) -> list[ToolEvent]:
        self._final = True
        while self._buf and self._step():
            pass
        if self._kind:
            self._close_message()
        header = self._header
        metadata = self._started or CHANNEL in header or _RECIPIENT.search(header)
        if header.strip() and not metadata:
            self._emit_content(self._marker_set.remove(header))  # not harmony at all
        self._header = ""
        if self._held_ws:
            self._events.append(self._held_ws)
            self._held_ws = ""
        return self._take_events()

    def _step(self) -> bool:
        found = self._marker_set.find(self._buf)
        if found is None:
            split = len(self._buf) - (0 if self._final else self._marker_set.held_len(self._buf))
            self._take(self._buf[:split])
            self._buf = self._buf[split:]
            return False
        pos, marker = found
        self._take(self._buf[:pos])
        self._buf = self._buf[pos + len(marker) :]
        if self._kind:
            if marker in _ENDS:
                self._close_message()
                self._started = marker == START
            return True  # a stray <|channel|>, <|message|> or <|constrain|> is dropped
        if marker == MESSAGE:
            self._open_message()
        elif marker in (CHANNEL, CONSTRAIN):
            self._header += marker
        else:  # the header ends without <|message|>: what it said is content
            if self._header.strip():
                self._emit_content(self._marker_set.remove(self._header))
            self._header = ""
            self._started = marker == START
        return True

    def _take(self, text: str) -> None:
        """Text of the open message's body, or of the header being read."""
        if not text:
            return
        if not self._kind:
            self._header += text
            return
        if self._kind == "call":
            self._call_arguments = True
            self._add_arguments(text)
            return
        text, self._separator = self._separator + text, ""
        self._wrote.add(self._kind)
        if self._kind == "reasoning":
            self._reasoning.append(text)
        else:
            self._emit_content(text)

    def _open_message(self) -> None:
        kind, name = header_kind(self._header, self._parse_tools)
        self._header = ""
        self._started = False
        self._kind = kind
        self._separator = "\n" if kind in self._wrote else ""
        if kind == "call":
            self._start_call(name)
            self._call_arguments = False

    def _close_message(self) -> None:
        if self._kind == "call":
            if not self._call_arguments:
                self._add_arguments("{}")
            self._end_call()
        self._kind = ""
        self._separator = ""


TOOL_PARSERS["harmony"] = HarmonyParser
