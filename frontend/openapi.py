"""GET /openapi.json: built from the same msgspec Structs the routes decode with, so the document
cannot drift from what the routes accept."""

from __future__ import annotations

import importlib.metadata
import re
from functools import cache
from typing import Any

import msgspec

from common.errors import AnthropicErrorResponse, ErrorResponse
from common.openai_schema import ChatCompletion, Completion, EmbeddingList
from frontend.anthropic import CountTokensRequest, MessagesRequest
from frontend.chat import ChatCompletionRequest
from frontend.completions import CompletionRequest
from frontend.embeddings import EmbeddingRequest
from frontend.lora import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from frontend.message_batches import CreateBatchRequest, MessageBatch
from frontend.responses import ResponsesRequest
from frontend.tokenize_schema import DetokenizeRequest, TokenizeRequest

REF = "#/components/schemas/{name}"

# path -> (method, summary, request schema, response schema)
ROUTES: dict[str, tuple[str, str, type | None, type | None]] = {
    "/v1/completions": ("post", "Create a completion", CompletionRequest, Completion),
    "/v1/chat/completions": (
        "post",
        "Create a chat completion",
        ChatCompletionRequest,
        ChatCompletion,
    ),
    "/v1/embeddings": ("post", "Create embeddings", EmbeddingRequest, EmbeddingList),
    "/v1/messages": ("post", "Create a message (Anthropic Messages API)", MessagesRequest, None),
    "/v1/messages/count_tokens": (
        "post",
        "Count a message's input tokens",
        CountTokensRequest,
        None,
    ),
    "/v1/messages/batches": (
        "post",
        "Create a message batch (GET lists them: limit, after_id, before_id)",
        CreateBatchRequest,
        MessageBatch,
    ),
    "/v1/messages/batches/{batch_id}": ("get", "A message batch (DELETE removes it)", None, None),
    "/v1/messages/batches/{batch_id}/cancel": ("post", "Cancel a message batch", None, None),
    "/v1/messages/batches/{batch_id}/results": ("get", "The results, JSONL", None, None),
    "/v1/responses": ("post", "Create a response (OpenAI Responses API)", ResponsesRequest, None),
    "/v1/responses/{response_id}": ("get", "A stored response (DELETE removes it)", None, None),
    "/v1/tokenize": ("post", "Tokenize a prompt or messages", TokenizeRequest, None),
    "/v1/detokenize": ("post", "Turn token ids into text", DetokenizeRequest, None),
    "/v1/models": ("get", "List the served model and its LoRA adapters", None, None),
    "/v1/models/{model_id}": ("get", "A served model's card (404 for any other id)", None, None),
    "/v1/load_lora_adapter": (
        "post",
        "Load a LoRA adapter on every engine worker",
        LoadLoRAAdapterRequest,
        None,
    ),
    "/v1/unload_lora_adapter": (
        "post",
        "Unload a LoRA adapter from every engine worker",
        UnloadLoRAAdapterRequest,
        None,
    ),
    "/version": ("get", "The server's version", None, None),
    "/health": ("get", "200 when every needed worker role is alive, else 503", None, None),
    "/health_generate": ("get", "200 when a one-token request completes", None, None),
    "/cluster_info": ("get", "Every process of the cluster, with its KV usage", None, None),
    "/server_info": ("get", "The model, the cluster's setup and its workers by role", None, None),
    "/kv_cache_events": ("post", "Drain the KV events (TensorRT-LLM's JSON)", None, None),
    "/start_profile": ("post", "Start the torch profiler on every engine worker", None, None),
    "/stop_profile": ("post", "Stop it; each worker writes its trace and op table", None, None),
    "/metrics": ("get", "Prometheus metrics of the frontends and every worker", None, None),
    "/prometheus/metrics": ("get", "The same Prometheus metrics (the seed's path)", None, None),
    "/steady_clock_offset": (
        "get",
        "receive_ts and transmit_ts on this host's monotonic clock (POST {offset}: not applied)",
        None,
        None,
    ),
    "/energy_metrics": ("get", "The host's energy counters (RAPL, NVML), or a 404", None, None),
}


@cache
def openapi_document() -> dict[str, Any]:
    types = [t for _, _, request, response in ROUTES.values() for t in (request, response) if t]
    errors = [ErrorResponse, AnthropicErrorResponse]
    refs, components = msgspec.json.schema_components([*types, *errors], ref_template=REF)
    by_type = dict(zip([*types, *errors], refs, strict=True))

    def error(shape: type, api: str) -> dict[str, Any]:
        return {
            "description": f"An error, in {api}'s shape",
            "content": {"application/json": {"schema": by_type[shape]}},
        }

    paths: dict[str, Any] = {}
    for path, (method, summary, request, response) in ROUTES.items():
        ok: dict[str, Any] = {"description": "OK"}
        if response is not None:
            ok["content"] = {
                "application/json": {"schema": by_type[response]},
                "text/event-stream": {"schema": {"type": "string"}},
            }
        failed = (
            error(AnthropicErrorResponse, "Anthropic")
            if path.startswith("/v1/messages")
            else error(ErrorResponse, "OpenAI")
        )
        operation: dict[str, Any] = {
            "summary": summary,
            "responses": {"200": ok, "default": failed},
        }
        names = re.findall(r"{(\w+)}", path)
        if names:
            operation["parameters"] = [
                {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
                for name in names
            ]
        if request is not None:
            operation["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": by_type[request]}},
            }
        paths[path] = {method: operation}
    return {
        "openapi": "3.1.0",
        "info": {"title": "pdcluster", "version": importlib.metadata.version("pdcluster")},
        "paths": paths,
        "components": {"schemas": components},
    }
