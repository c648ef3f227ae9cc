"""Reasoning and tool-call parsers for chat output (see pipeline.py for how they chain).

`OutputOptions.parser_state` (a `ParserState`, common/parser_choice.py, sent by the frontend)
names them; its names are the keys of `REASONING_PARSERS` and `TOOL_PARSERS`. None, a state
naming no parser, or kind "completion" leaves the output exactly as without parsers.
"""

from postproc_worker.parsers.pipeline import ChoiceParsers, ParsedText, special_texts
from postproc_worker.parsers.reasoning import REASONING_PARSERS, ReasoningParser
from postproc_worker.parsers.tools import TOOL_PARSERS, ToolCallStart, ToolParser

__all__ = [
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "ChoiceParsers",
    "ParsedText",
    "ReasoningParser",
    "ToolCallStart",
    "ToolParser",
    "special_texts",
]
