"""A chat choice's text through its parsers, and the OpenAI message pieces that come out.

    text ──▶ special tokens out ──▶ ReasoningParser ──reasoning─────────────▶ reasoning_content
             (but the markers)                      ──content──▶ ToolParser ──▶ DistinctCalls
                                                           ──▶ content, tool_calls (no repeats)

The frontend asks for parsers in `OutputOptions.parser_state` (common/parser_choice.py); the
postproc worker then decodes the choice with special tokens kept, whatever `skip_special_tokens`
says, so that markers which are special tokens (`[TOOL_CALLS]`, `<｜tool▁calls▁begin｜>`) reach
the parsers, and removes the other special tokens (`<|im_end|>`, `<|eot_id|>`) here.

Harmony (gpt-oss) is one parser for both: the channels carry the reasoning, the content and the
calls (harmony.py), so "harmony" as either parser name runs it in place of the two.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache

from msgspec import UNSET

from common.openai_schema import (
    ChatMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from common.parser_choice import ParserState
from common.tokenizer import Tokenizer
from postproc_worker.parsers.distinct_calls import DistinctCalls
from postproc_worker.parsers.harmony import HarmonyParser
from postproc_worker.parsers.markers import MarkerFilter, Markers
from postproc_worker.parsers.reasoning import REASONING_PARSERS, ReasoningParser
from postproc_worker.parsers.tools import (
    TOOL_PARSERS,
    ToolCallArguments,
    ToolCallStart,
    ToolEvent,
    ToolParser,
)


@dataclass(slots=True)
class ParsedText:
    """What one piece of a choice's text became, in output order."""

    reasoning: str = ""
    events: list[ToolEvent] = field(default_factory=list)  # content (str) and tool-call events

    @property
    def content(self) -> str:
        return "".join(e for e in self.events if isinstance(e, str))

    def delta(self) -> DeltaMessage:
        """The streamed delta: a call's id, type and name only with its first fragment."""
        calls: list[tuple[ToolCallStart | None, int, list[str]]] = []
        for event in self.events:
            if isinstance(event, ToolCallStart):
                calls.append((event, event.index, []))
            elif isinstance(event, ToolCallArguments):
                if not calls or calls[-1][1] != event.index:
                    calls.append((None, event.index, []))
                calls[-1][2].append(event.text)
        content = self.content
        return DeltaMessage(
            content=content or UNSET,
            reasoning_content=self.reasoning or UNSET,
            tool_calls=[_delta_tool_call(*call) for call in calls] or UNSET,
        )

    def message(self) -> ChatMessage:
        """The whole choice's message (non-streaming): null content when there is none."""
        calls: list[ToolCall] = []
        for event in self.events:
            if isinstance(event, ToolCallStart):
                calls.append(
                    ToolCall(id=event.id, function=FunctionCall(name=event.name, arguments=""))
                )
            elif isinstance(event, ToolCallArguments):
                calls[event.index].function.arguments += event.text
        return ChatMessage(
            content=self.content or None,
            reasoning_content=self.reasoning or UNSET,
            tool_calls=calls or UNSET,
        )


def _delta_tool_call(start: ToolCallStart | None, index: int, pieces: list[str]) -> DeltaToolCall:
    arguments = "".join(pieces)
    if start is None:
        return DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=arguments))
    return DeltaToolCall(
        index=index,
        id=start.id,
        type="function",
        function=DeltaFunctionCall(name=start.name, arguments=arguments),
    )


class ChoiceParsers:
    """One choice's parsers, fed its visible text delta by delta (or all at once, non-streaming)."""

    def __init__(self, state: ParserState, special_texts: frozenset[str]) -> None:
        channels = state.reasoning_parser is not None and (
            REASONING_PARSERS[state.reasoning_parser].channels
        )
        self._harmony = (
            HarmonyParser(parse_tools=state.tool_parser is not None)
            if channels or state.tool_parser == "harmony"
            else None
        )
        self._reasoning = (
            ReasoningParser(
                REASONING_PARSERS[state.reasoning_parser],
                False if state.in_tool_call else state.thinking,  # a forced call is not thought
            )
            if state.reasoning_parser is not None and self._harmony is None
            else None
        )
        self._tools: ToolParser | None = self._harmony or (
            TOOL_PARSERS[state.tool_parser](in_tool_call=state.in_tool_call)
            if state.tool_parser is not None
            else None
        )
        self._distinct = DistinctCalls()
        keep = (self._reasoning.markers if self._reasoning else ()) + (
            self._tools.markers if self._tools else ()
        )
        self._special = MarkerFilter(_drop_markers(special_texts, keep))

    @property
    def num_tool_calls(self) -> int:
        return self._tools.num_calls if self._tools is not None else 0

    def feed(self, text: str, *, final: bool = False) -> ParsedText:
        """`final`: the choice's text ends here; everything held back comes out."""
        text = self._special.feed(text)
        if final:
            text += self._special.finish()
        reasoning, content = "", text
        if self._reasoning is not None:
            reasoning, content = self._reasoning.feed(text)
            if final:
                more_reasoning, more_content = self._reasoning.finish()
                reasoning, content = reasoning + more_reasoning, content + more_content
        if self._tools is None:
            return ParsedText(reasoning, [content] if content else [])
        events = self._tools.feed(content)
        if final:
            events += self._tools.finish()
        events = self._distinct.feed(events, final=final)
        if self._harmony is not None:
            reasoning = self._harmony.take_reasoning()
        return ParsedText(reasoning, events)


@cache
def special_texts(tokenizer: Tokenizer) -> frozenset[str]:
    """The text of every special token (one tokenizer per worker: computed once)."""
    texts = (tokenizer.id_to_token(i) for i in tokenizer.special_ids)
    return frozenset(t for t in texts if t)


@cache
def _drop_markers(special: frozenset[str], keep: tuple[str, ...]) -> Markers:
    return Markers(special - set(keep))
