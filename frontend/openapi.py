"""GET /openapi.json: built from the same msgspec Structs the routes decode with, so the document
cannot drift from what the routes accept."""

from __future__ import annotations

import importlib.metadata
from functools import cache
from typing import Any

import msgspec

from common.errors import ErrorResponse
from common.openai_schema import ChatCompletion, Completion
from frontend.anthropic import CountTokensRequest, MessagesRequest
from frontend.chat import ChatCompletionRequest
from frontend.completions import CompletionRequest
from frontend.tokenize_schema import DetokenizeRequest, TokenizeRequest

REF = "#/components/schemas/{name}"

# path -> (summary, request schema or None for GET, response schema or None)
ROUTES: dict[str, tuple[str, type | None, type | None]] = {
    "/v1/completions": ("Create a completion", CompletionRequest, Completion),
    "/v1/chat/completions": ("Create a chat completion", ChatCompletionRequest, ChatCompletion),
    "/v1/messages": ("Create a message (Anthropic Messages API)", MessagesRequest, None),
    "/v1/messages/count_tokens": ("Count a message's input tokens", CountTokensRequest, None),
    "/v1/tokenize": ("Tokenize a prompt or messages", TokenizeRequest, None),
    "/v1/detokenize": ("Turn token ids into text", DetokenizeRequest, None),
    "/v1/models": ("List the served model", None, None),
    "/version": ("The server's version", None, None),
    "/health": ("200 when every needed worker role is alive, else 503", None, None),
    "/health_generate": ("200 when a one-token request completes", None, None),
    "/cluster_info": ("Every process of the cluster, with its KV usage", None, None),
}


@cache
def openapi_document() -> dict[str, Any]:
    types = [t for _, request, response in ROUTES.values() for t in (request, response) if t]
    refs, components = msgspec.json.schema_components([*types, ErrorResponse], ref_template=REF)
    by_type = dict(zip([*types, ErrorResponse], refs, strict=True))
    error = {
        "description": "An error, in OpenAI's shape",
        "content": {"application/json": {"schema": by_type[ErrorResponse]}},
    }
    paths: dict[str, Any] = {}
    for path, (summary, request, response) in ROUTES.items():
        ok: dict[str, Any] = {"description": "OK"}
        if response is not None:
            ok["content"] = {
                "application/json": {"schema": by_type[response]},
                "text/event-stream": {"schema": {"type": "string"}},
            }
        operation: dict[str, Any] = {"summary": summary, "responses": {"200": ok, "default": error}}
        if request is not None:
            operation["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": by_type[request]}},
            }
        paths[path] = {"post" if request is not None else "get": operation}
    return {
        "openapi": "3.1.0",
        "info": {"title": "pdcluster", "version": importlib.metadata.version("pdcluster")},
        "paths": paths,
        "components": {"schemas": components},
    }
