"""Bodies and stream events checked against the official OpenAI OpenAPI description
(../shared/reference/openai-openapi.json, from the openai-openapi repository)."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

SPEC = Path(__file__).resolve().parents[3] / "shared/reference/openai-openapi.json"

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
    if not SPEC.is_file():
        pytest.skip(f"the official OpenAPI description is not beside this checkout ({SPEC})")
    document = json.loads(SPEC.read_text())
    registry = Registry().with_resource(
        "openai", Resource.from_contents(document, default_specification=DRAFT202012)
    )
    return jsonschema.Draft202012Validator(
        {"$ref": f"openai#/components/schemas/{schema_name}"}, registry=registry
    )


def check(schema_name: str, body: Any) -> None:
    """AssertionError listing where `body` departs from the official schema."""
    validator = _validator(schema_name)
    errors = [f"{e.json_path}: {e.message[:200]}" for e in validator.iter_errors(body)]
    assert not errors, (schema_name, errors[:5])
