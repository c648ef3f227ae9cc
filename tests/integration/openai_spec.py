"""Bodies and stream events checked against the official OpenAI OpenAPI description (from the
openai-openapi repository): its schemas that the tests use, extracted into
tests/data/openai-schemas.json (tests/data/extract_openai_schemas.py), so CI checks them too."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

SCHEMAS = Path(__file__).resolve().parents[1] / "data/openai-schemas.json"

# Responses stream event type -> its schema in the description
RESPONSE_EVENTS = {
    "response.created": "ResponseCreatedEvent",
    "response.in_progress": "ResponseInProgressEvent",
    "response.completed": "ResponseCompletedEvent",
    "response.incomplete": "ResponseIncompleteEvent",
    "response.output_item.added": "ResponseOutputItemAddedEvent",
    "response.output_item.done": "ResponseOutputItemDoneEvent",
    "response.content_part.added": "ResponseContentPartAddedEvent",
    "response.content_part.done": "ResponseContentPartDoneEvent",
    "response.output_text.delta": "ResponseTextDeltaEvent",
    "response.output_text.done": "ResponseTextDoneEvent",
    "response.reasoning_text.delta": "ResponseReasoningTextDeltaEvent",
    "response.reasoning_text.done": "ResponseReasoningTextDoneEvent",
    "response.function_call_arguments.delta": "ResponseFunctionCallArgumentsDeltaEvent",
    "response.function_call_arguments.done": "ResponseFunctionCallArgumentsDoneEvent",
}


@cache
def _validator(schema_name: str) -> jsonschema.Draft202012Validator:
    document = _nullable_as_json_schema(json.loads(SCHEMAS.read_text()))
    registry = Registry().with_resource(
        "openai", Resource.from_contents(document, default_specification=DRAFT202012)
    )
    return jsonschema.Draft202012Validator(
        {"$ref": f"openai#/components/schemas/{schema_name}"}, registry=registry
    )


def _nullable_as_json_schema(node: Any) -> Any:
    """The description is OpenAPI 3.1 but still marks some fields with 3.0's `nullable: true`
    (chunks' `finish_reason`, `logprobs`, `usage`: null on the wire in OpenAI's own answers),
    which JSON Schema ignores: read it as "or null"."""
    if isinstance(node, list):
        return [_nullable_as_json_schema(v) for v in node]
    if not isinstance(node, dict):
        return node
    node = {k: _nullable_as_json_schema(v) for k, v in node.items()}
    if node.pop("nullable", False):
        return {"anyOf": [node, {"type": "null"}]}
    return node


def check(schema_name: str, body: Any) -> None:
    """AssertionError listing where `body` departs from the official schema."""
    validator = _validator(schema_name)
    errors = [f"{e.json_path}: {e.message[:200]}" for e in validator.iter_errors(body)]
    assert not errors, (schema_name, errors[:5])
