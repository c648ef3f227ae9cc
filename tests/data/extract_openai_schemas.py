"""Writes openai-schemas.json: the schemas of the official OpenAI OpenAPI description that the
tests check bodies against (tests/integration/openai_spec.py), with everything they refer to.

The description (../shared/reference/openai-openapi.json, from the openai-openapi repository) is
3 MB and not in this repository; the extract is, so that CI checks the bodies too. Run again
when the description changes:

    .venv/bin/python tests/data/extract_openai_schemas.py path/to/openai-openapi.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOTS = [
    "CreateCompletionResponse",
    "CreateChatCompletionResponse",
    "CreateChatCompletionStreamResponse",
    "CreateEmbeddingResponse",
    "ListModelsResponse",
    "Model",
    "ErrorResponse",
    "Response",
    "ResponseCreatedEvent",
    "ResponseInProgressEvent",
    "ResponseCompletedEvent",
    "ResponseIncompleteEvent",
    "ResponseOutputItemAddedEvent",
    "ResponseOutputItemDoneEvent",
    "ResponseContentPartAddedEvent",
    "ResponseContentPartDoneEvent",
    "ResponseTextDeltaEvent",
    "ResponseTextDoneEvent",
    "ResponseReasoningTextDeltaEvent",
    "ResponseReasoningTextDoneEvent",
    "ResponseFunctionCallArgumentsDeltaEvent",
    "ResponseFunctionCallArgumentsDoneEvent",
]
PREFIX = "#/components/schemas/"


def references(node: Any) -> set[str]:
    if isinstance(node, dict):
        found = {node["$ref"][len(PREFIX) :]} if isinstance(node.get("$ref"), str) else set()
        return found.union(*(references(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(references(v) for v in node))
    return set()


def extract(document: dict[str, Any]) -> dict[str, Any]:
    schemas = document["components"]["schemas"]
    kept: dict[str, Any] = {}
    todo = list(ROOTS)
    while todo:
        name = todo.pop()
        if name not in kept:
            kept[name] = schemas[name]
            todo.extend(references(schemas[name]))
    return {
        "info": {"source": "openai-openapi", "version": document["info"]["version"]},
        "components": {"schemas": dict(sorted(kept.items()))},
    }


if __name__ == "__main__":
    source = Path(sys.argv[1])
    out = HERE / "openai-schemas.json"
    out.write_text(json.dumps(extract(json.loads(source.read_text())), indent=1) + "\n")
    print(f"{out}: {out.stat().st_size} bytes")
