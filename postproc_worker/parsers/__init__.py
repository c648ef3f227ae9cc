"""Reasoning and tool-call parsers for chat output (see pipeline.py for how they chain).

`OutputOptions.parser_state` (sent by the frontend, read as `ParserState`):

    {"reasoning_parser": "qwen3" | "deepseek-r1",   # absent: no reasoning_content
     "thinking": true | false | null,               # resolve_prefilled_thinking(template output)
     "tool_parser": "hermes" | "qwen3" | "llama3_json" | "mistral" | "deepseek_v3",
     "in_tool_call": true}                          # the prompt ends with the parser's `begin`

An empty dict (or kind "completion") leaves the output exactly as without parsers.
"""

from postproc_worker.parsers.pipeline import ChoiceParsers, ParsedText, ParserState, special_texts
from postproc_worker.parsers.reasoning import REASONING_PARSERS, ReasoningParser
from postproc_worker.parsers.tools import TOOL_PARSERS, ToolCallStart, ToolParser

__all__ = [
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "ChoiceParsers",
    "ParsedText",
    "ParserState",
    "ReasoningParser",
    "ToolCallStart",
    "ToolParser",
    "special_texts",
]
