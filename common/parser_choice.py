"""Which reasoning and tool-call parser a model gets, by its config.json model_type, and the
parser state a chat request carries to its postproc worker.

The frontend decides (it knows the model and the request) and sends a `ParserState`; the
postproc worker looks the names up in its parser registries (postproc_worker/parsers/), whose
keys are exactly the names here (a unit test holds them equal).
"""

from __future__ import annotations

from typing import Literal, get_args

import msgspec

# "harmony" (gpt-oss) is both: its channels carry reasoning, content and calls alike
ReasoningParserName = Literal["qwen3", "deepseek-r1", "harmony"]
ToolParserName = Literal["hermes", "qwen3", "llama3_json", "mistral", "deepseek_v3", "harmony"]
REASONING_PARSER_NAMES: frozenset[str] = frozenset(get_args(ReasoningParserName))
TOOL_PARSER_NAMES: frozenset[str] = frozenset(get_args(ToolParserName))

REASONING_PARSER_FOR_MODEL_TYPE: dict[str, ReasoningParserName] = {
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3",
    "deepseek_v3": "deepseek-r1",
    "gpt_oss": "harmony",
}

TOOL_PARSER_FOR_MODEL_TYPE: dict[str, ToolParserName] = {
    "qwen2": "hermes",
    "qwen2_moe": "hermes",
    "qwen3": "hermes",
    "qwen3_moe": "hermes",
    "llama": "llama3_json",
    "mistral": "mistral",
    "mixtral": "mistral",
    "deepseek_v3": "deepseek_v3",
    "gpt_oss": "harmony",
}
# Models whose prompts are rendered in harmony (common/harmony.py), not by a chat template.
HARMONY_MODEL_TYPES = frozenset({"gpt_oss"})
DEFAULT_TOOL_PARSER: ToolParserName = "hermes"


def reasoning_parser_for(model_type: str) -> ReasoningParserName | None:
    return REASONING_PARSER_FOR_MODEL_TYPE.get(model_type)


def tool_parser_for(model_type: str) -> ToolParserName:
    return TOOL_PARSER_FOR_MODEL_TYPE.get(model_type, DEFAULT_TOOL_PARSER)


class ParserState(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, forbid_unknown_fields=True
):
    """The parsers a chat request asks for (`OutputOptions.parser_state`), and the state each
    choice's output starts in: the frontend sets it from the request and the rendered prompt.

    Checked when built and when decoded (msgspec runs `__post_init__` on decode), so an unknown
    parser name never reaches a postproc worker.
    """

    reasoning_parser: ReasoningParserName | None = None
    thinking: bool | None = None  # common.thinking.resolve_prefilled_thinking of the template
    tool_parser: ToolParserName | None = None  # set only when the request has tools
    in_tool_call: bool = False  # the prompt ends with the tool parser's `begin` (a forced call)

    def __post_init__(self) -> None:
        # msgspec checks the Literals on decode only; these hold when the frontend builds one
        if self.reasoning_parser not in (None, *REASONING_PARSER_NAMES):
            raise ValueError(f"unknown reasoning_parser {self.reasoning_parser!r}")
        if self.tool_parser not in (None, *TOOL_PARSER_NAMES):
            raise ValueError(f"unknown tool_parser {self.tool_parser!r}")
        if self.in_tool_call and self.tool_parser is None:
            raise ValueError("in_tool_call needs a tool_parser")

    @property
    def active(self) -> bool:
        return self.reasoning_parser is not None or self.tool_parser is not None
