"""JSON schemas closed to undeclared keys before they become grammars: each key of an object once.

A JSON schema object that declares `properties` and says nothing of other keys allows any other
key (JSON Schema's default). llguidance writes each declared property at most once, but an
undeclared key is free text, so a grammar built from such a schema lets the model write
`"skills": [], "skills": []` or repeat any other key: a context-free grammar cannot remember which
free keys it has written. Closing the object (`additionalProperties: false` where the schema left
it open) makes its keys the declared ones, each at most once. xgrammar does the same by default
(its `strict_mode`, vLLM's default backend); a schema that wants extra keys says so
(`additionalProperties: true` or a schema, `patternProperties`), and is left as it is.

Members of an `allOf` are not closed on their own (each would forbid the others' properties);
what they nest is.
"""

from __future__ import annotations

from typing import Any

_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
# keywords whose value is one schema, a list of schemas, or a name -> schema map
_ONE = ("items", "additionalItems", "not", "if", "then", "else", "contains", "propertyNames")
_LIST = ("anyOf", "oneOf", "prefixItems")
_MAP = ("properties", "$defs", "definitions", "dependentSchemas")


def closed(schema: Any) -> Any:
    """`schema` with every object that declares properties and leaves other keys unsaid closed
    to them (a copy; the client's schema is not changed)."""
    return _close(schema, in_all_of=False)


def _close(schema: Any, *, in_all_of: bool) -> Any:
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE:
        if key in out:
            out[key] = _close(out[key], in_all_of=False)
    for key in _LIST:
        if isinstance(out.get(key), list):
            out[key] = [_close(s, in_all_of=False) for s in out[key]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [_close(s, in_all_of=True) for s in out["allOf"]]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: _close(s, in_all_of=False) for name, s in out[key].items()}
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = _close(out["additionalProperties"], in_all_of=False)
    if (
        isinstance(out.get("properties"), dict)
        and not in_all_of
        and "allOf" not in out
        and not any(k in out for k in _OPEN_KEYS)
    ):
        out["additionalProperties"] = False
    return out
