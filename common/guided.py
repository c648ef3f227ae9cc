"""Guided decoding specs: what the frontend turns response_format, guided_* and tool_choice into,
as llguidance grammars (torch-free; the engine's sampler applies them as token masks).

One grammar per request, whatever asked for it:

    response_format json_object / json_schema, guided_json → a JSON-schema grammar
    guided_regex, guided_grammar (Lark)                     → a regex / Lark grammar
    tool_choice "required"   → one or more <tool_call>{"name": ..., "arguments": ...}</tool_call>,
                               after the thinking the model is in, or may open
    tool_choice named        → {"name": f, "arguments": ...}</tool_call>, after the injected
                               "<tool_call>\\n" (the frontend appends it to the rendered prompt)

Tool calls use the Hermes / Qwen format the served chat template teaches the model.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any, Literal

import llguidance

from common.errors import InvalidRequest
from common.sampling_params import GuidedDecoding

TOOL_CALL_BEGIN = "<tool_call>\n"  # what a forced call's prompt ends with
TOOL_CALL_END = "</tool_call>"


def _call_tags(tags_are_tokens: bool) -> tuple[str, str]:
    """The Lark for a call's opening and closing. Where the tokenizer has the tags as tokens
    (Qwen's), they are written unquoted, Lark for "this token": the model emits them as one
    token, never as their characters. Elsewhere (SmolLM2's) they are plain text."""
    if tags_are_tokens:
        return '<tool_call> "\\n"', '"\\n" </tool_call>'
    return '"<tool_call>\\n"', '"\\n</tool_call>"'


# JSON without free whitespace runs: a weak model would otherwise spend its tokens on blanks.
_COMPACT: Any = {"whitespace_flexible": False}  # llguidance JsonCompileOptions


def json_schema(schema: dict[str, Any], source: str = "json_schema") -> GuidedDecoding:
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_COMPACT)
    except ValueError as e:
        raise InvalidRequest(f"{source}: not a usable JSON schema: {e}", source) from None
    return GuidedDecoding(grammar=grammar, source=source)


def regex(pattern: str) -> GuidedDecoding:
    return GuidedDecoding(
        grammar=llguidance.LLMatcher.grammar_from_regex(pattern), source="guided_regex"
    )


def lark(text: str) -> GuidedDecoding:
    return GuidedDecoding(
        grammar=llguidance.LLMatcher.grammar_from_lark(text), source="guided_grammar"
    )


def tool_call_schema(function: dict[str, Any]) -> dict[str, Any]:
    """The JSON object a call of `function` is: its name, and arguments under its schema."""
    parameters = function.get("parameters") or {"type": "object"}
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


ThinkingMode = Literal["off", "open", "optional"]
# Thinking before forced calls, where <think> and </think> are tokens: any text up to the end
# token (text cannot contain a token, so the end is unambiguous), then the blank the model puts
# after it, a few characters (unbounded, a weak model can fill max_tokens with newlines).
# "open": the prompt ends inside <think>; "optional": the model may open a block.
_THOUGHT = {
    "off": "",
    "open": "/(?s:.*)/ </think> /[ \\n]{0,4}/ ",
    "optional": "(<think> /(?s:.*)/ </think> /[ \\n]{0,4}/)? ",
}


def required_tool_calls(
    functions: list[dict[str, Any]],
    tags_are_tokens: bool = True,
    parallel: bool = True,
    thinking: ThinkingMode = "off",
) -> GuidedDecoding:
    """At least one call of one of the tools (exactly one unless `parallel`), each inside
    <tool_call> tags, nothing else but the thinking before them that `thinking` allows."""
    schema = {"anyOf": [tool_call_schema(f) for f in functions], "x-guidance": _COMPACT}
    begin, end = _call_tags(tags_are_tokens)
    more = ' ("\\n" call)*' if parallel else ""
    text = (
        f"start: {_THOUGHT[thinking]}call{more}\ncall: {begin} %json {json.dumps(schema)} {end}\n"
    )
    return GuidedDecoding(
        grammar=llguidance.LLMatcher.grammar_from_lark(text), source="tool_choice"
    )


def answer_or_tool_calls(
    answer_schema: dict[str, Any], functions: list[dict[str, Any]], tags_are_tokens: bool = True
) -> GuidedDecoding:
    """Either the answer, under its JSON schema, or one or more calls of the tools."""
    answer = {**answer_schema, "x-guidance": _COMPACT}
    calls = {"anyOf": [tool_call_schema(f) for f in functions], "x-guidance": _COMPACT}
    begin, end = _call_tags(tags_are_tokens)
    text = (
        'start: answer | call ("\\n" call)*\n'
        f"answer: %json {json.dumps(answer)}\n"
        f"call: {begin} %json {json.dumps(calls)} {end}\n"
    )
    return GuidedDecoding(
        grammar=llguidance.LLMatcher.grammar_from_lark(text), source="response_format"
    )


def named_tool_call(function: dict[str, Any], tags_are_tokens: bool = True) -> GuidedDecoding:
    """The rest of one call of `function` after the injected TOOL_CALL_BEGIN."""
    schema = json.dumps({**tool_call_schema(function), "x-guidance": _COMPACT})
    text = f"start: %json {schema} {_call_tags(tags_are_tokens)[1]}\n"
    return GuidedDecoding(
        grammar=llguidance.LLMatcher.grammar_from_lark(text), source="tool_choice"
    )


def triggered_tool_calls(functions: list[dict[str, Any]]) -> GuidedDecoding:
    """Free text, but once the model opens <tool_call>, the call must be valid (strict tools)."""
    tags = [
        llguidance.StructTag(
            trigger="<tool_call>",
            begin=TOOL_CALL_BEGIN,
            grammar={**tool_call_schema(f), "x-guidance": _COMPACT},
            end="\n</tool_call>",
        )
        for f in functions
    ]
    grammar = llguidance.LLMatcher.grammar_from_lark(llguidance.StructTag.to_grammar(tags))
    return GuidedDecoding(grammar=grammar, source="tools")


@cache
def _ll_tokenizer(
    tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...]
) -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids))


def ll_tokenizer(
    model_dir: Path, vocab_size: int, eos_token_ids: tuple[int, ...]
) -> llguidance.LLTokenizer:
    """The model's tokenizer as llguidance sees it (built once per process: about a second)."""
    return _ll_tokenizer((model_dir / "tokenizer.json").read_text(), vocab_size, eos_token_ids)


def check(spec: GuidedDecoding, tokenizer: llguidance.LLTokenizer) -> None:
    """A grammar that does not compile is the client's 400, found before any worker sees it."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        spec.grammar, tokenizer
    )
    if is_error:
        raise InvalidRequest(
            f"{spec.source}: the constraint does not compile: {messages[0]}", spec.source
        )
