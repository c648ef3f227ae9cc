"""A choice's tool calls without repeats: a call with the name and arguments (as JSON values) of
an earlier call of the same choice is dropped, and the calls after it are renumbered.

A small model that may make several calls (tool_choice required with parallel_tool_calls, or
auto) often writes the same call twice, and an agent loop would run the tool twice. Whether a
call repeats one is known only once it ends, so every call after the first is held until then
(its next event, content, or the end of the output); the first streams as it comes.

    parser events ──▶ DistinctCalls ──▶ the events the client sees (calls numbered 0, 1, ...)
"""

from __future__ import annotations

import json
from typing import Any

from postproc_worker.parsers.tools import ToolCallArguments, ToolCallStart, ToolEvent


class DistinctCalls:
    def __init__(self) -> None:
        self._seen: list[tuple[str, Any]] = []  # the calls let through: name, arguments
        self._open: int | None = None  # the parser's index of the call going on
        self._name = ""
        self._arguments: list[str] = []
        self._held: list[ToolEvent] = []  # a later call's events, until it ends
        self._renumber: dict[int, int] = {}  # parser index -> index the client sees

    def feed(self, events: list[ToolEvent], *, final: bool = False) -> list[ToolEvent]:
        out: list[ToolEvent] = []
        for event in events:
            index = event.index if not isinstance(event, str) else None
            if index != self._open:
                out += self._end_call()
            if isinstance(event, ToolCallStart):
                self._start_call(event, out)
            elif isinstance(event, ToolCallArguments):
                self._arguments.append(event.text)
                self._route(ToolCallArguments(self._renumber[event.index], event.text), out)
            else:
                out.append(event)
        if final:
            out += self._end_call()
        return out

    def _start_call(self, start: ToolCallStart, out: list[ToolEvent]) -> None:
        self._open, self._name, self._arguments = start.index, start.name, []
        self._renumber[start.index] = len(self._seen)
        self._route(ToolCallStart(len(self._seen), start.id, start.name), out)

    def _route(self, event: ToolEvent, out: list[ToolEvent]) -> None:
        """The first call streams; a later one waits until it is known not to repeat."""
        (out if not self._seen else self._held).append(event)

    def _end_call(self) -> list[ToolEvent]:
        if self._open is None:
            return []
        self._open = None
        call = (self._name, _value("".join(self._arguments)))
        held, self._held = self._held, []
        if self._seen and call in self._seen:
            return []  # a repeat: dropped, and the next call takes its number
        self._seen.append(call)
        return held


def _value(arguments: str) -> Any:
    """Arguments as a JSON value to compare (`{"a": 1}` repeats `{"a":1}`), else as written."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments
