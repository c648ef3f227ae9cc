"""From a request's response_format, guided_* extensions and tool_choice to one constraint, the
prompt prefix a forced tool call needs, and what the tool parser must know.

    tool_choice none / auto (no strict tool)  → no constraint; the parser finds calls in the text
    auto with strict tools                    → free text, calls constrained once opened
    required                                  → at least one call, constrained (thinking first,
                                                where the model thinks)
    named function                            → Hermes: "<tool_call>\\n" appended to the rendered
                                                prompt (both halves: the prefix AND the schema),
                                                and the parser starts inside a call; other
                                                formats: one call of it, by the grammar alone

A forced call (required, named) beside a response_format (or guided_*): a 400, as the seed
says: the call leaves no text for the format to shape, and keeping either would drop the
client's other instruction. `required` makes one call unless `parallel_tool_calls` is true (the
model repeats a call it is let to make again); several calls that repeat one (same name, same
arguments) are dropped by the postproc worker (postproc_worker/parsers/distinct_calls.py).
A tool's parameters hold at most MAX_TOOL_ENUM_VALUES enum values (the seed's cap).

Harmony (gpt-oss, common/guided.py): every forced call by the grammar alone, one per output
(<|call|> stops it, so parallel_tool_calls changes nothing); tool_choice none is a grammar too
(an answer on the final channel, no call), which a response_format replaces (it allows no call
either); response_format and guided_* shape the final channel's text (chat.py nests them there).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import msgspec

from common import guided
from common.errors import InvalidRequest
from common.guided import HERMES, CallSyntax
from common.sampling_params import GuidedDecoding

MAX_TOOL_ENUM_VALUES = 1000  # the seed's TOOL_PARAM_MAX_ENUM_VALUES, per tool


class ResponseFormat(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: str  # text | json_object | json_schema
    json_schema: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class ToolPlan:
    guided: GuidedDecoding | None = None
    prompt_prefix: str = ""  # appended after the template's output
    parse_tools: bool = False  # run the tool-call parser on the output
    in_tool_call: bool = False  # the output starts inside a call (the prefix opened it)
    stop: tuple[str, ...] = ()  # stop strings to add (the end of the one allowed call)
    # tool_choice auto: the functions, for a grammar that also lets the answer take a format
    functions: tuple[dict[str, Any], ...] = ()
    syntax: CallSyntax = HERMES  # how calls are written (auto + format)
    no_calls: bool = False  # harmony tool_choice none: `guided` allows no call


def from_guided_fields(
    response_format: ResponseFormat | None,
    guided_json: dict[str, Any] | str | None,
    guided_regex: str | None,
    guided_grammar: str | None,
) -> GuidedDecoding | None:
    specs = []
    if response_format is not None and response_format.type != "text":
        specs.append(_response_format(response_format))
    if guided_json is not None:
        try:
            schema = json.loads(guided_json) if isinstance(guided_json, str) else guided_json
        except ValueError as e:
            raise InvalidRequest(f"guided_json is not JSON: {e}", "guided_json") from None
        if not isinstance(schema, dict):
            raise InvalidRequest("guided_json must be a JSON schema object", "guided_json")
        specs.append(guided.json_schema(schema, "guided_json"))
    if guided_regex is not None:
        specs.append(guided.regex(guided_regex))
    if guided_grammar is not None:
        specs.append(guided.lark(guided_grammar))
    if len(specs) > 1:
        raise InvalidRequest(
            "give at most one of response_format, guided_json, guided_regex and guided_grammar",
            specs[1].source,
        )
    return specs[0] if specs else None


def _response_format(response_format: ResponseFormat) -> GuidedDecoding:
    if response_format.type == "json_object":
        return guided.json_schema({"type": "object"}, "response_format")
    if response_format.type == "json_schema":
        spec = response_format.json_schema or {}
        if not isinstance(spec.get("schema"), dict):
            raise InvalidRequest(
                "response_format.json_schema.schema must be a JSON schema object", "response_format"
            )
        return guided.json_schema(spec["schema"], "response_format")
    raise InvalidRequest(
        f"response_format type {response_format.type!r} is not text, json_object or json_schema",
        "response_format",
    )


def plan_tools(
    tools: list[dict[str, Any]],
    tool_choice: str | dict[str, Any] | None,
    syntax: CallSyntax = HERMES,
    parallel: bool | None = None,
    thinking: guided.ThinkingMode = "off",
) -> ToolPlan:
    """`tools`: the request's tools as plain dicts ({"type": "function", "function": {...}});
    `syntax`: the tool parser's call format as the tokenizer spells it; `parallel`
    (parallel_tool_calls): False, one call at most, by the grammar where there is one, else by
    stopping where the first call closes; None (not sent), several under auto but one under
    required. `thinking`: what a required call's grammar lets the model do before the calls
    (common/guided.py)."""
    functions = [t["function"] for t in tools]
    check_enum_cap(functions)
    if tool_choice == "none" and tools and syntax.format.channels:
        return ToolPlan(guided=guided.no_tool_calls(syntax), no_calls=True)
    if tool_choice == "none" or not tools:
        if tool_choice not in (None, "none", "auto"):
            raise InvalidRequest(f"tool_choice {tool_choice!r} needs tools", "tool_choice")
        return ToolPlan()
    if tool_choice in (None, "auto"):
        # strict tools are held to their schema once a Hermes call opens; other formats'
        # calls are parsed, not constrained (README: tool_choice required / named force them)
        hermes = syntax.format is guided.CALL_FORMATS["hermes"]
        strict = [f for f in functions if f.get("strict")] if hermes else []
        return ToolPlan(
            guided=guided.triggered_tool_calls(strict) if strict else None,
            parse_tools=True,
            stop=() if parallel is not False or syntax.format.single else (guided.TOOL_CALL_END,),
            functions=tuple(functions),
            syntax=syntax,
        )
    if tool_choice == "required":
        return ToolPlan(
            guided=guided.required_tool_calls(functions, syntax, parallel is True, thinking),
            parse_tools=True,
        )
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        chosen = [f for f in functions if f["name"] == name]
        if not chosen:
            raise InvalidRequest(
                f"tool_choice names {name!r}, which is not in tools", "tool_choice"
            )
        if syntax.format is not guided.CALL_FORMATS["hermes"]:
            call = guided.required_tool_calls(chosen, syntax, parallel=False, thinking=thinking)
            return ToolPlan(guided=call, parse_tools=True)
        return ToolPlan(
            guided=guided.named_tool_call(chosen[0], syntax),
            prompt_prefix=guided.TOOL_CALL_BEGIN,
            parse_tools=True,
            in_tool_call=True,
        )
    raise InvalidRequest(
        'tool_choice must be none, auto, required or {"type": "function", ...}', "tool_choice"
    )


def check_enum_cap(functions: list[dict[str, Any]]) -> None:
    """The seed's cap on a tool's enum values (all its parameters' `enum` lists together): a
    grammar over more alternatives than that is slow to build for every request that sends it."""
    for i, function in enumerate(functions):
        count = _enum_values(function.get("parameters"))
        if count > MAX_TOOL_ENUM_VALUES:
            raise InvalidRequest(
                f"tool {function.get('name')!r} has {count} enum values in its parameters, "
                f"over the cap of {MAX_TOOL_ENUM_VALUES}",
                f"tools[{i}].function.parameters",
            )


def _enum_values(schema: Any) -> int:
    if isinstance(schema, list):
        return sum(_enum_values(s) for s in schema)
    if not isinstance(schema, dict):
        return 0
    own = len(schema["enum"]) if isinstance(schema.get("enum"), list) else 0
    nested = (v for k, v in schema.items() if k not in _DATA_KEYWORDS and not (k == "enum" and own))
    return own + sum(_enum_values(v) for v in nested)


_DATA_KEYWORDS = ("const", "default", "examples")  # values, not schemas


def answer_schema(
    response_format: ResponseFormat | None, guided_json: dict[str, Any] | str | None
) -> dict[str, Any] | None:
    """The JSON schema the answer's text must follow, when the constraint is one (the others,
    regex and Lark, cannot be joined with tool calls)."""
    if response_format is not None and response_format.type == "json_object":
        return {"type": "object"}
    if response_format is not None and response_format.type == "json_schema":
        return (response_format.json_schema or {}).get("schema")
    if isinstance(guided_json, dict):
        return guided_json
    return None


def combine(
    tool_plan: ToolPlan, other: GuidedDecoding | None, schema: dict[str, Any] | None = None
) -> GuidedDecoding | None:
    """The one grammar of a request.

    - a forced call (required, named) beside a response_format or guided_*: refused (the seed's
      rule: the call leaves no text for the format to shape; keeping one drops the other);
    - tool_choice auto beside a JSON format (`schema`): the answer in that format, or calls
      (what an agent with tools and an output type asks for on every turn);
    - auto with strict tools beside a regex or Lark constraint: refused.
    """
    if tool_plan.no_calls and other is not None:
        return other
    if tool_plan.guided is not None and tool_plan.guided.source == "tool_choice":
        if other is not None:
            raise InvalidRequest(
                f"{other.source} cannot be combined with a forced tool_choice (required or a "
                "named function): the call leaves no text for it to shape; send one or the other",
                other.source,
            )
        return tool_plan.guided
    if tool_plan.parse_tools and other is not None and schema is not None:
        return guided.answer_or_tool_calls(schema, list(tool_plan.functions), tool_plan.syntax)
    if tool_plan.guided is not None and other is not None:
        raise InvalidRequest(
            f"{other.source} cannot be combined with tool_choice {tool_plan.guided.source!r}: "
            "both constrain the whole output",
            other.source,
        )
    return tool_plan.guided or other
