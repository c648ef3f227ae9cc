"""Function tools as harmony declares them to gpt-oss: TypeScript-like types in a namespace.

    ## functions

    namespace functions {

    // Gets the current weather in the provided location.
    type get_current_weather = (_: {
    // The city and state, e.g. San Francisco, CA
    location: string,
    format?: "celsius" | "fahrenheit", // default: celsius
    }) => any;

    } // namespace functions

The layout is byte for byte what OpenAI's renderer (the `openai-harmony` package, which vLLM
uses) writes, quirks included (a nested object's description printed twice, `oneOf` variants one
per line), because the model was trained on that renderer's output: tests/unit/common/
test_harmony_reference.py compares the two on generated schemas. Property order is the schema's.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

FUNCTIONS_NAMESPACE = "functions"


def rust_lines(text: str) -> list[str]:
    """`text` split as Rust's `str::lines` splits it: at "\\n", a "\\r" before it dropped, and
    no empty last line after a final newline (Python's splitlines splits at more characters)."""
    if not text:
        return []
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    return [line.removesuffix("\r") for line in lines]


def json_text(value: Any) -> str:
    """A JSON value as serde_json's Display writes it: compact, non-ASCII kept."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _is_enum(schema: Any) -> bool:
    enum = schema.get("enum") if isinstance(schema, dict) else None
    return isinstance(enum, list) and bool(enum)


def _text(schema: dict[str, Any], key: str) -> str | None:
    value = schema.get(key)
    return value if isinstance(value, str) else None


def _default_comment(schema: dict[str, Any], *, raw_enum_string: bool) -> str:
    """`default: ...` for a schema with a default: a string quoted as written, or (property
    level, enums) bare; any other value as JSON."""
    default = schema["default"]
    if isinstance(default, str) and not _is_enum(schema):
        return f'default: "{default}"'
    if isinstance(default, str) and raw_enum_string:
        return f"default: {default}"
    return f"default: {json_text(default)}"


def _nullable(schema: Any, rendered: str) -> str:
    nullable = isinstance(schema, dict) and schema.get("nullable") is True
    return f"{rendered} | null" if nullable and "null" not in rendered else rendered


def typescript(schema: Any, indent: str = "") -> str:
    """The TypeScript-like type of a JSON schema (unknown shapes are `any`)."""
    if not isinstance(schema, dict):
        return "any"
    one_of = schema.get("oneOf")
    if isinstance(one_of, list):
        return _union(one_of, indent)
    kind = schema.get("type")
    if isinstance(kind, list):
        names = ["number" if k == "integer" else k for k in kind if isinstance(k, str)]
        if names:
            return " | ".join(names)
        return "any"
    if kind == "object":
        return _object(schema, indent)
    if kind == "string":
        enum = schema.get("enum")
        values = [f'"{v}"' for v in enum if isinstance(v, str)] if isinstance(enum, list) else []
        return " | ".join(values) if values else "string"
    if kind in ("number", "integer"):
        return "number"
    if kind == "boolean":
        return "boolean"
    if kind == "array":
        return f"{typescript(schema['items'], indent)}[]" if "items" in schema else "Array<any>"
    return "any"


def _union(variants: list[Any], indent: str) -> str:
    """A `oneOf` as a value's type: each variant on its own line, with its comments."""
    out = []
    for variant in variants:
        line = f"\n{indent} | " + _nullable(variant, typescript(variant, indent + "   "))
        comments = _variant_comments(variant, describe=True, raw_enum_string=False)
        out.append(line + (f" // {' '.join(comments)}" if comments else ""))
    return "".join(out)


def _variant_comments(
    variant: Any, *, describe: bool, raw_enum_string: bool, unless: str | None = None
) -> list[str]:
    """A variant's trailing comments: its description (when `describe`, and not `unless`),
    then its default."""
    if not isinstance(variant, dict):
        return []
    comments = []
    description = _text(variant, "description")
    if describe and description is not None and description != unless:
        comments.append(description)
    if "default" in variant:
        comments.append(_default_comment(variant, raw_enum_string=raw_enum_string))
    return comments


def _object(schema: dict[str, Any], indent: str) -> str:
    out = []
    description = _text(schema, "description")
    if description is not None:
        out.append(f"{indent}// {description}\n")
    out.append("{\n")
    properties = schema.get("properties")
    if isinstance(properties, dict):
        required = schema.get("required")
        names = {r for r in required if isinstance(r, str)} if isinstance(required, list) else set()
        for key, value in properties.items():
            out.append(_property(key, value, key in names, indent))
    out.append(f"{indent}}}")
    return "".join(out)


def _property(key: str, value: Any, required: bool, indent: str) -> str:
    optional = "" if required else "?"
    if not isinstance(value, dict):
        return f"{indent}{key}{optional}: any,\n"
    out = []
    title = _text(value, "title")
    if title is not None:
        out.append(f"{indent}// {title}\n{indent}//\n")
    one_of = value.get("oneOf")
    description = _text(value, "description")
    if "oneOf" not in value and description is not None:
        out.append(f"{indent}// {description}\n")
    examples = value.get("examples")
    if isinstance(examples, list) and examples:
        out.append(f"{indent}// Examples:\n")
        out.extend(f'{indent}// - "{e}"\n' for e in examples if isinstance(e, str))
    if isinstance(one_of, list):
        out.append(_one_of_property(key, value, one_of, optional, indent))
        return "".join(out)
    rendered = _nullable(value, typescript(value, indent + "    "))
    out.append(f"{indent}{key}{optional}: {rendered},")
    if "oneOf" not in value and "default" in value:
        out.append(" // " + _default_comment(value, raw_enum_string=True))
    return "".join(out) + "\n"


def _one_of_property(
    key: str, value: dict[str, Any], variants: list[Any], optional: str, indent: str
) -> str:
    """A property whose schema is a `oneOf`: its comments above it, one variant a line."""
    out = []
    description = _text(value, "description")
    first = variants[0] if variants else None
    first_description = _text(first, "description") if isinstance(first, dict) else None
    described_above = description is not None and description != first_description
    if described_above:
        out.append(f"{indent}// {description}\n")
    if "default" in value:
        out.append(f"{indent}// {_default_comment(value, raw_enum_string=True)}\n")
    out.append(f"{indent}{key}{optional}:\n")
    for i, variant in enumerate(variants):
        line = f"{indent} | " + _nullable(variant, typescript(variant, indent + "   "))
        # the property's description above stands for the first variant's
        comments = _variant_comments(
            variant,
            describe=not (i == 0 and described_above),
            raw_enum_string=True,
            unless=description,
        )
        out.append(line + (f" // {' '.join(comments)}" if comments else "") + "\n")
    out.append(f"{indent},\n")
    return "".join(out)


def tool_namespace(functions: Sequence[dict[str, Any]], name: str = FUNCTIONS_NAMESPACE) -> str:
    """The `## functions` section: each function's description lines as comments, then its
    type (`() => any` when it declares no parameters at all)."""
    lines = [f"## {name}\n", f"namespace {name} {{\n"]
    for function in functions:
        lines.extend(f"// {line}" for line in rust_lines(function.get("description") or ""))
        parameters = function.get("parameters")
        if parameters is None:
            lines.append(f"type {function['name']} = () => any;\n")
        else:
            lines.append(f"type {function['name']} = (_: {typescript(parameters)}) => any;\n")
    lines.append(f"}} // namespace {name}")
    return "\n".join(lines)
