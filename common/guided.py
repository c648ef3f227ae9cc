"""Guided decoding specs: what the frontend turns response_format, guided_* and tool_choice into,
as llguidance grammars (torch-free; the engine's sampler applies them as token masks).

One grammar per request, whatever asked for it:

    response_format json_object / json_schema, guided_json → a JSON-schema grammar
    guided_regex, guided_grammar (Lark)                     → a regex / Lark grammar
    tool_choice "required"   → one or more calls in the tool parser's format (Hermes'
                               <tool_call>{"name": ..., "arguments": ...}</tool_call>, Llama 3's
                               {"name": ..., "parameters": ...}; ..., Mistral's [TOOL_CALLS][...],
                               DeepSeek-V3's marked blocks), after the thinking the model is in,
                               or may open
    tool_choice named        → Hermes: {"name": f, "arguments": ...}</tool_call>, after the injected
                               "<tool_call>\\n" (the frontend appends it to the rendered prompt);
                               the other formats: one call of f, the whole block

Calls take the format of the tool parser in use (`tool_parser`), the one the chat template or
frontend/tool_prompt.py teaches the model and the postproc worker reads.

Harmony (gpt-oss) outputs are messages: a constrained output may open with one free analysis
message (the model reasons before anything: forbidding it would push it off its training),
then what the constraint asks for, in its channel:

    required / named   <|channel|>commentary to=functions.f <|constrain|>json<|message|>{args}
                       <|call|>: one call (<|call|> is a stop token: one call per output)
    none               <|channel|>final<|message|> any text: no call
    response_format,   <|channel|>final<|message|> and the constraint on the answer's text
    guided_*           (`final_answer`: the request's grammar nested under the final header)
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Literal

import llguidance

from common import harmony
from common.closed_schema import closed
from common.errors import InvalidRequest
from common.sampling_params import GuidedDecoding

TOOL_CALL_BEGIN = "<tool_call>\n"  # what a Hermes forced call's prompt ends with
TOOL_CALL_END = "</tool_call>"


@dataclass(frozen=True, slots=True)
class CallFormat:
    """How one tool parser's format writes calls (frontend/tool_prompt.py teaches it to models
    whose template does not, postproc_worker/parsers/tools.py reads it): what a grammar that
    forces calls spells out. `call` is one call, with `{json}` standing for the call's object
    (name and arguments under `arguments_key`), or `{name}` and `{arguments}` for a format
    that writes the name outside the JSON; `markers`: the format's special tokens."""

    call: str
    begin: str = ""  # before the first call
    separator: str = "\n"  # between calls
    end: str = ""  # after the last
    arguments_key: str = "arguments"
    markers: tuple[str, ...] = ()
    # harmony: the message a constrained output may open with ("{text}": free), where the
    # answer goes ("{answer}"), and whether a call ends the output (one call per output)
    thought: str = ""
    answer: str = "{answer}"
    single: bool = False

    @property
    def channels(self) -> bool:
        """Harmony: calls and answers are messages of their own, never inside the text."""
        return bool(self.thought)


_HERMES = CallFormat("<tool_call>\n{json}\n</tool_call>", markers=("<tool_call>", "</tool_call>"))
_DEEPSEEK_MARKERS = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                     "<｜tool▁call▁end｜>", "<｜tool▁sep｜>")  # fmt: skip
CALL_FORMATS: dict[str, CallFormat] = {
    "hermes": _HERMES,
    "qwen3": _HERMES,
    "llama3_json": CallFormat("{json}", separator="; ", arguments_key="parameters"),
    "mistral": CallFormat(
        "{json}", begin="[TOOL_CALLS][", separator=", ", end="]", markers=("[TOOL_CALLS]",)
    ),
    "deepseek_v3": CallFormat(
        "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{arguments}\n```"
        "<｜tool▁call▁end｜>",
        begin="<｜tool▁calls▁begin｜>",
        separator="",
        end="<｜tool▁calls▁end｜>",
        markers=_DEEPSEEK_MARKERS,
    ),
    "harmony": CallFormat(
        harmony.call_header("{name}") + "{arguments}" + harmony.CALL,
        separator="",
        markers=harmony.MARKERS,
        thought=f"{harmony.CHANNEL}analysis{harmony.MESSAGE}{{text}}{harmony.END}"
        f"{harmony.GENERATION_PROMPT}",
        answer=f"{harmony.CHANNEL}final{harmony.MESSAGE}{{answer}}",
        single=True,
    ),
}


@dataclass(frozen=True, slots=True)
class CallSyntax:
    """A call format as the served tokenizer spells it: a marker that is one token there is
    written in the grammar as that token (`<[id]>`), which the model emits as such, never as its
    characters; elsewhere (SmolLM2's <tool_call>) it is plain text."""

    format: CallFormat = _HERMES
    marker_ids: tuple[tuple[str, int], ...] = ()

    @classmethod
    def of(cls, tool_parser: str, token_id: Callable[[str], int | None]) -> CallSyntax:
        fmt = CALL_FORMATS[tool_parser]
        ids = ((m, token_id(m)) for m in fmt.markers)
        return cls(fmt, tuple((m, i) for m, i in ids if i is not None))

    def literal(self, text: str) -> str:
        """Lark for `text`: its markers as tokens where they are, the rest quoted."""
        ids = dict(self.marker_ids)
        pieces = re.split(f"({'|'.join(map(re.escape, ids))})", text) if ids else [text]
        return " ".join(
            f"<[{ids[p]}]>" if p in ids else json.dumps(p, ensure_ascii=False) for p in pieces if p
        )

    def fill(self, template: str, values: dict[str, str]) -> str:
        """Lark for `template` with its placeholders (keys of `values`) replaced by Lark."""
        pattern = "(" + "|".join(map(re.escape, values)) + ")"
        pieces = re.split(pattern, template)
        return " ".join(values[p] if p in values else self.literal(p) for p in pieces if p)

    def call(self, function: dict[str, Any]) -> str:
        """Lark for one call of `function`."""
        return self.fill(
            self.format.call,
            {
                "{json}": _json_rule(tool_call_schema(function, self.format.arguments_key)),
                "{arguments}": _json_rule(_parameters(function)),
                "{name}": json.dumps(function["name"], ensure_ascii=False),
            },
        )

    def thought(self, thinking: ThinkingMode) -> str:
        """Lark for what may come before the calls or the answer (its own trailing space)."""
        if not self.format.thought:
            return _THOUGHT[thinking]
        if thinking == "off":
            return ""
        return f"({self.fill(self.format.thought, {'{text}': '/(?s:.*)/'})})? "

    def preface(self) -> str:
        """Lark for what a constrained answer may open with: the format's own message for
        thought (harmony's analysis), else nothing (a `<think>` block is not taken for one)."""
        return self.thought("optional") if self.format.thought else ""

    def answer(self, body: str) -> str:
        """Lark for an answer whose text is the Lark `body`, where the format puts answers."""
        return self.fill(self.format.answer, {"{answer}": body})

    def calls_rules(self, functions: list[dict[str, Any]], parallel: bool = True) -> str:
        """Lark rules `calls` (the format's whole block of one or more calls, one unless
        `parallel`) and `call` (any one of `functions`)."""
        fmt = self.format
        parallel = parallel and not fmt.single
        more = f" ({self.literal(fmt.separator)} call)*" if parallel else ""  # "( call)*": none
        block = " ".join(
            filter(None, [self.literal(fmt.begin), f"call{more}", self.literal(fmt.end)])
        )
        alternatives = " | ".join(self.call(f) for f in functions)
        return f"calls: {block}\ncall: {alternatives}\n"


HERMES = CallSyntax()  # the format without tokens for its tags (the default)


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    """The schema of a function's arguments (none given: any object)."""
    return function.get("parameters") or {"type": "object"}


def _json_rule(schema: dict[str, Any]) -> str:
    """Lark for a JSON value under `schema`, its objects closed to undeclared keys (each key
    once: common/closed_schema.py)."""
    return f"%json {json.dumps({**closed(schema), 'x-guidance': _COMPACT}, ensure_ascii=False)}"


# JSON without free whitespace runs: a weak model would otherwise spend its tokens on blanks.
_COMPACT: Any = {"whitespace_flexible": False}  # llguidance JsonCompileOptions


def json_schema(schema: dict[str, Any], source: str = "json_schema") -> GuidedDecoding:
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(closed(schema), defaults=_COMPACT)
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


def tool_call_schema(function: dict[str, Any], arguments_key: str = "arguments") -> dict[str, Any]:
    """The JSON object a call of `function` is: its name, and arguments under its schema."""
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, arguments_key: _parameters(function)},
        "required": ["name", arguments_key],
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
    syntax: CallSyntax = HERMES,
    parallel: bool = True,
    thinking: ThinkingMode = "off",
) -> GuidedDecoding:
    """At least one call of one of the tools (exactly one unless `parallel`) in the format's
    block, nothing else but the thinking before them that `thinking` allows."""
    text = f"start: {syntax.thought(thinking)}calls\n{syntax.calls_rules(functions, parallel)}"
    return GuidedDecoding(
        grammar=llguidance.LLMatcher.grammar_from_lark(text), source="tool_choice"
    )


def answer_or_tool_calls(
    answer_schema: dict[str, Any],
    functions: list[dict[str, Any]],
    syntax: CallSyntax = HERMES,
) -> GuidedDecoding:
    """Either the answer, under its JSON schema, or one or more calls of the tools (harmony:
    after the analysis the model may write first)."""
    text = (
        f"start: {syntax.preface()}(answer | calls)\n"
        f"answer: {syntax.answer(_json_rule(answer_schema))}\n" + syntax.calls_rules(functions)
    )
    return GuidedDecoding(
        grammar=llguidance.LLMatcher.grammar_from_lark(text), source="response_format"
    )


def final_answer(spec: GuidedDecoding, syntax: CallSyntax) -> GuidedDecoding:
    """`spec` (a response_format or guided_* grammar) on the answer's text only, where the
    format puts answers (harmony: the final channel, after the analysis it may write first).
    The request's grammar is nested as it is, as llguidance's sub-grammar `@answer`."""
    text = spec.grammar.lstrip()  # llguidance's grammars: JSON, or Lark text as it is
    inner = json.loads(text)["grammars"] if text.startswith("{") else [{"lark_grammar": text}]
    start = f"start: {syntax.preface()}{syntax.answer('@answer')}\n"
    grammars = [{"lark_grammar": start}, {**inner[0], "name": "answer"}, *inner[1:]]
    return GuidedDecoding(grammar=json.dumps({"grammars": grammars}), source=spec.source)


def no_tool_calls(syntax: CallSyntax) -> GuidedDecoding:
    """tool_choice none where calls are messages of their own (harmony): any answer, no call."""
    text = f"start: {syntax.preface()}{syntax.answer('/(?s:.*)/')}\n"
    return GuidedDecoding(
        grammar=llguidance.LLMatcher.grammar_from_lark(text), source="tool_choice"
    )


def named_tool_call(function: dict[str, Any], syntax: CallSyntax = HERMES) -> GuidedDecoding:
    """The rest of one Hermes call of `function` after the injected TOOL_CALL_BEGIN."""
    end = syntax.literal("\n" + TOOL_CALL_END)
    text = f"start: {_json_rule(tool_call_schema(function))} {end}\n"
    return GuidedDecoding(
        grammar=llguidance.LLMatcher.grammar_from_lark(text), source="tool_choice"
    )


def triggered_tool_calls(functions: list[dict[str, Any]]) -> GuidedDecoding:
    """Free text, but once the model opens <tool_call>, the call must be valid (strict tools)."""
    tags = [
        llguidance.StructTag(
            trigger="<tool_call>",
            begin=TOOL_CALL_BEGIN,
            grammar={**closed(tool_call_schema(f)), "x-guidance": _COMPACT},
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
