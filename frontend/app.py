"""The HTTP surface (starlette): validate, translate, hand the request to the cluster, relay the
postproc workers' bytes. Every error has the one OpenAI shape (`common.errors.error_body`).
Literal routes only; an API key (when configured) guards everything but /health.

`build_app` assembles: the route table below (the handlers live in one module per API), the
middleware, the exception handlers and the lifespan; the handlers read the cluster client, the
model and the configuration from `app.state.frontend` (frontend/endpoint.py).
"""

from __future__ import annotations

import contextlib
import hmac
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from common.config import ClusterConfig
from common.errors import InvalidRequest
from frontend import (
    admin_routes,
    anthropic_routes,
    lora,
    metrics,
    openai_routes,
    ops_routes,
    render_routes,
    responses_routes,
)
from frontend.batch_store import open_batch_store
from frontend.cluster_client import ClusterClient
from frontend.endpoint import FrontendState, NotFound
from frontend.generation import error_response
from frontend.message_batches import BatchRunner
from frontend.model_info import ModelInfo
from frontend.response_store import open_store

HTTP_ROUTES = [
    Route("/v1/completions", openai_routes.create_completion, methods=["POST"]),
    Route("/v1/chat/completions", openai_routes.create_chat_completion, methods=["POST"]),
    Route("/v1/embeddings", openai_routes.create_embedding, methods=["POST"]),
    Route("/v1/messages", anthropic_routes.create_message, methods=["POST"]),
    Route("/v1/responses", responses_routes.create_response, methods=["POST"]),
    Route("/v1/responses/{response_id}", responses_routes.retrieve_response, methods=["GET"]),
    Route("/v1/responses/{response_id}", responses_routes.delete_response, methods=["DELETE"]),
    Route("/v1/messages/count_tokens", anthropic_routes.count_message_tokens, methods=["POST"]),
    Route("/v1/messages/batches", anthropic_routes.create_message_batch, methods=["POST"]),
    Route("/v1/messages/batches", anthropic_routes.list_message_batches, methods=["GET"]),
    Route(
        "/v1/messages/batches/{batch_id}",
        anthropic_routes.retrieve_message_batch,
        methods=["GET"],
    ),
    Route(
        "/v1/messages/batches/{batch_id}",
        anthropic_routes.delete_message_batch,
        methods=["DELETE"],
    ),
    Route(
        "/v1/messages/batches/{batch_id}/cancel",
        anthropic_routes.cancel_message_batch,
        methods=["POST"],
    ),
    Route(
        "/v1/messages/batches/{batch_id}/results",
        anthropic_routes.message_batch_results,
        methods=["GET"],
    ),
    Route("/v1/models", admin_routes.list_models, methods=["GET"]),
    Route("/v1/load_lora_adapter", lora.load_lora_adapter, methods=["POST"]),
    Route("/v1/unload_lora_adapter", lora.unload_lora_adapter, methods=["POST"]),
    Route("/v1/models/{model_id:path}", admin_routes.retrieve_model, methods=["GET"]),
    Route("/v1/tokenize", admin_routes.tokenize, methods=["POST"]),
    Route("/v1/detokenize", admin_routes.detokenize, methods=["POST"]),
    Route("/version", admin_routes.version, methods=["GET"]),
    Route("/health", admin_routes.health, methods=["GET"]),
    Route("/health_generate", admin_routes.health_generate, methods=["GET"]),
    Route("/cluster_info", admin_routes.cluster_info, methods=["GET"]),
    Route("/server_info", admin_routes.server_info, methods=["GET"]),
    Route("/kv_cache_events", admin_routes.kv_cache_events, methods=["POST"]),
    Route("/start_profile", admin_routes.start_profile, methods=["POST"]),
    Route("/stop_profile", admin_routes.stop_profile, methods=["POST"]),
    Route("/metrics", ops_routes.metrics, methods=["GET"]),
    Route("/prometheus/metrics", admin_routes.prometheus_metrics, methods=["GET"]),
    Route("/steady_clock_offset", ops_routes.steady_clock_offset, methods=["GET"]),
    Route("/steady_clock_offset", ops_routes.set_steady_clock_offset, methods=["POST"]),
    Route("/energy_metrics", ops_routes.energy_metrics, methods=["GET"]),
    Route("/openapi.json", admin_routes.openapi, methods=["GET"]),
]


def build_app(config: ClusterConfig, client: ClusterClient, model: ModelInfo) -> Starlette:
    """The app over `client`: the route table, the stores and batch runner in its state, the
    API-key and request-count middleware, and a lifespan that starts and closes the client."""
    routes = HTTP_ROUTES + (render_routes.ROUTES if config.frontend.render_endpoints else [])
    app = Starlette(
        routes=routes,
        lifespan=_lifespan,
        exception_handlers={
            InvalidRequest: _invalid_request,
            HTTPException: _http_exception,
            Exception: _server_error,
        },
    )
    response_store = open_store(config.frontend.responses_store)
    batch_store = open_batch_store(config.frontend.responses_store)
    app.state.frontend = FrontendState(
        config=config,
        client=client,
        model=model,
        response_store=response_store,
        batch_store=batch_store,
        lora_adapters=dict(config.lora.adapters) if config.lora else {},
        batches=BatchRunner(
            batch_store,
            client,
            model,
            config.frontend.batch_concurrency,
            config.frontend.request_timeout_seconds,
        ),
    )
    if config.frontend.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=config.frontend.api_key)
    app.add_middleware(metrics.RequestCounter, routes=frozenset(r.path for r in routes))
    return app


@contextlib.asynccontextmanager
async def _lifespan(app: Starlette) -> AsyncIterator[None]:
    state: FrontendState = app.state.frontend
    await state.client.start()
    try:
        yield
    finally:
        await state.batches.close()
        await state.client.close()


def media_of(path: str) -> str:
    """Which API's error shape a route answers in: Anthropic's on /v1/messages."""
    return "anthropic" if path.startswith("/v1/messages") else "openai"


class ApiKeyMiddleware:
    """401 unless `Authorization: Bearer <key>` or `x-api-key: <key>` (the Anthropic SDK's
    header); /health stays open for probes."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            headers = dict(scope["headers"])
            bearer = headers.get(b"authorization", b"")
            given = bearer[len(b"Bearer ") :] if bearer.startswith(b"Bearer ") else None
            if given is None:
                given = headers.get(b"x-api-key", b"")
            if not hmac.compare_digest(given, self.expected):
                response = error_response(
                    401, "a valid API key is required", code="invalid_api_key",
                    media=media_of(scope["path"]),
                )  # fmt: skip
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _invalid_request(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, InvalidRequest)
    media = media_of(request.url.path)
    if isinstance(exc, NotFound):
        return error_response(404, exc.message, exc.param, exc.code, media=media)
    return error_response(400, exc.message, exc.param, media=media)


async def _http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    media, path = media_of(request.url.path), request.url.path
    if exc.status_code == 404:
        return error_response(404, f"no route {path}", code="not_found", media=media)
    if exc.status_code == 405:
        return error_response(405, f"{request.method} is not allowed on {path}", media=media)
    if exc.status_code == 413:
        return error_response(413, str(exc.detail), code="request_too_large", media=media)
    return error_response(exc.status_code, str(exc.detail), media=media)


async def _server_error(request: Request, exc: Exception) -> Response:
    media = media_of(request.url.path)
    return error_response(500, "internal error", code="internal_error", media=media)
