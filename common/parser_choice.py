"""Which reasoning and tool-call parser a model gets, by its config.json model_type.

The frontend decides (it knows the model and the request) and sends the names in the request's
parser state; the postproc worker looks them up in its parser registries.
"""

from __future__ import annotations

REASONING_PARSER_FOR_MODEL_TYPE = {
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3",
    "deepseek_v3": "deepseek-r1",
}

TOOL_PARSER_FOR_MODEL_TYPE = {
    "qwen2": "hermes",
    "qwen2_moe": "hermes",
    "qwen3": "hermes",
    "qwen3_moe": "hermes",
    "llama": "llama3_json",
    "mistral": "mistral",
    "deepseek_v3": "deepseek_v3",
}
DEFAULT_TOOL_PARSER = "hermes"


def reasoning_parser_for(model_type: str) -> str | None:
    return REASONING_PARSER_FOR_MODEL_TYPE.get(model_type)


def tool_parser_for(model_type: str) -> str:
    return TOOL_PARSER_FOR_MODEL_TYPE.get(model_type, DEFAULT_TOOL_PARSER)
