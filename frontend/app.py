"""The HTTP surface (starlette): validate, translate, hand the request to the cluster, relay the
postproc workers' bytes. Every error has the one OpenAI shape (`common.errors.error_body`).
Literal routes only; an API key (when configured) guards everything but /health.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import importlib.metadata
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from common.block_hash import HASH_ALGORITHM
from common.config import ClusterConfig
from common.errors import InvalidRequest, validation_location
from common.protocol import (
    PROTOCOL_VERSION,
    Chunk,
    GenerateRequest,
    OutputOptions,
    encode,
    encode_token_ids,
)
from common.sampling_params import SamplingParams
from frontend import (
    anthropic,
    chat,
    completions,
    embeddings,
    message_batches,
    metrics,
    responses,
)
from frontend.batch_store import BatchRecord, open_batch_store
from frontend.cluster_client import ClusterClient
from frontend.generation import error_response, serve
from frontend.message_batches import BatchRunner
from frontend.model_info import ModelInfo
from frontend.openapi import ROUTES, openapi_document
from frontend.profiling import profile_response
from frontend.response_store import open_store
from frontend.tokenize_schema import DetokenizeRequest, TokenizeRequest

HEALTH_TIMEOUT_S = 1.0
HEALTH_GENERATE_TIMEOUT_S = 30.0
T = TypeVar("T")


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


def build_app(config: ClusterConfig, client: ClusterClient, model: ModelInfo) -> Starlette:
    needed_roles = {"generation", "postproc"} | (
        {"context"} if config.mode == "disaggregated" else set()
    )
    max_body = config.frontend.max_body_bytes
    store = open_store(config.frontend.responses_store)
    request_timeout_s = config.frontend.request_timeout_seconds
    batch_store = open_batch_store(config.frontend.responses_store)
    batches = BatchRunner(
        batch_store, client, model, config.frontend.batch_concurrency, request_timeout_s
    )

    async def decode_body(request: Request, schema: type[T]) -> T:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_body:
            raise HTTPException(413, f"the request body is over {max_body} bytes")
        body = await request.body()
        if len(body) > max_body:
            raise HTTPException(413, f"the request body is over {max_body} bytes")
        try:
            return msgspec.json.decode(body, type=schema)
        except msgspec.ValidationError as e:
            raise InvalidRequest(str(e), _param_of(str(e))) from None
        except msgspec.DecodeError as e:
            raise InvalidRequest(f"the body is not valid JSON: {e}") from None
        except RecursionError:
            raise InvalidRequest("the body nests too deeply") from None

    def check_model(name: str | None) -> None:
        if name is not None and name != model.name:
            raise _NotFound(f"the model {name!r} does not exist", "model", "model_not_found")

    async def off_loop(fn: Callable[..., T], *args: Any) -> T:
        """Tokenizing and template rendering run in a thread: the loop only orchestrates."""
        return await asyncio.to_thread(fn, *args)

    async def translate(
        fn: Callable[..., list[GenerateRequest]], *args: Any
    ) -> list[GenerateRequest]:
        """A request body to the cluster's messages, off the loop. Translation reads nothing but
        the client's data, so whatever it trips over there is the client's 400, never a 500;
        the messages are encoded once here so that what cannot cross the wire (an integer
        beyond 64 bits) is found before the cluster or the open-request table sees it."""
        try:
            generates = await off_loop(fn, *args)
            for generate in generates:
                encode(generate)
        except InvalidRequest:
            raise
        except (ValueError, OverflowError, RecursionError) as e:
            raise InvalidRequest(f"the request cannot be served: {e}") from None
        return generates

    async def create_completion(request: Request) -> Response:
        body = await decode_body(request, completions.CompletionRequest)
        check_model(body.model)
        generates = await translate(completions.to_generate_requests, body, model, client.reply_to)
        return await serve(request, client, generates, timeout_s=request_timeout_s)

    async def create_embedding(request: Request) -> Response:
        body = await decode_body(request, embeddings.EmbeddingRequest)
        check_model(body.model)
        generates = await translate(embeddings.to_generate_requests, body, model, client.reply_to)
        return await serve(request, client, generates, timeout_s=request_timeout_s)

    async def create_chat_completion(request: Request) -> Response:
        body = await decode_body(request, chat.ChatCompletionRequest)
        check_model(body.model)
        generates = await translate(
            lambda: [
                chat.to_generate_request(
                    body, model, client.reply_to, config.frontend.allow_request_chat_template
                )
            ]
        )
        return await serve(request, client, generates, timeout_s=request_timeout_s)

    async def create_message(request: Request) -> Response:
        body = await decode_body(request, anthropic.MessagesRequest)
        check_model(body.model)
        generates = await translate(
            lambda: [anthropic.to_generate_request(body, model, client.reply_to)]
        )
        return await serve(
            request, client, generates, media="anthropic", timeout_s=request_timeout_s
        )

    async def create_response(request: Request) -> Response:
        body = await decode_body(request, responses.ResponsesRequest)
        check_model(body.model)
        history: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            stored = await off_loop(store.get, body.previous_response_id)
            if stored is None:
                raise _NotFound(f"no stored response {body.previous_response_id!r}",
                                "previous_response_id", "response_not_found")  # fmt: skip
            history = stored[1]
        generates = await translate(
            lambda: [responses.to_generate_request(body, history, model, client.reply_to)]
        )
        answer = await serve(
            request, client, generates, media="responses", timeout_s=request_timeout_s
        )
        if not body.store or answer.status_code != 200:
            return answer
        turns = [*history, *responses.input_messages(body.input)]
        if isinstance(answer, StreamingResponse):
            answer.body_iterator = _store_when_done(answer.body_iterator, turns)
        else:
            await off_loop(store.put, bytes(answer.body), turns)
        return answer

    async def _store_when_done(frames: Any, turns: list[dict[str, Any]]) -> AsyncIterator[Any]:
        """Relay a response's events; the final one (completed or incomplete) is stored."""
        async for frame in frames:
            yield frame
            final = responses_format_final(frame)
            if final is not None:
                await off_loop(store.put, final, turns)

    async def retrieve_response(request: Request) -> Response:
        stored = await off_loop(store.get, request.path_params["response_id"])
        if stored is None:
            raise _NotFound("no such stored response", "response_id", "response_not_found")
        return Response(stored[0], media_type="application/json")

    async def delete_response(request: Request) -> Response:
        response_id = request.path_params["response_id"]
        if not await off_loop(store.delete, response_id):
            raise _NotFound("no such stored response", "response_id", "response_not_found")
        return _json({"id": response_id, "object": "response.deleted", "deleted": True})

    async def create_message_batch(request: Request) -> Response:
        body = await decode_body(request, message_batches.CreateBatchRequest)
        for item in body.requests:
            check_model(item.params.model)
        items = message_batches.parse_items(body)
        batch_id = message_batches.new_batch_id()
        await off_loop(batch_store.create, batch_id, time.time(), items)
        batches.start(batch_id, items)
        return await batch_answer(request, batch_id)

    async def batch_record(batch_id: str) -> BatchRecord:
        record = await off_loop(batch_store.get, batch_id)
        if record is None:
            raise _NotFound(f"no message batch {batch_id!r}", "batch_id", "not_found_error")
        return record

    async def batch_answer(request: Request, batch_id: str) -> Response:
        record = await batch_record(batch_id)
        return _json(message_batches.view(record, str(request.base_url), time.time()))

    async def retrieve_message_batch(request: Request) -> Response:
        return await batch_answer(request, request.path_params["batch_id"])

    async def list_message_batches(request: Request) -> Response:
        query = request.query_params
        limit = query.get("limit", "20")
        if not limit.isdigit() or not 1 <= int(limit) <= 1000:
            raise InvalidRequest("limit must be an integer from 1 to 1000", "limit")
        records = await off_loop(
            lambda: [r for r in map(batch_store.get, batch_store.ids()) if r is not None]
        )
        now, base = time.time(), str(request.base_url)
        views = [message_batches.view(r, base, now) for r in records]
        page = message_batches.page(
            views, int(limit), query.get("after_id"), query.get("before_id")
        )
        return _json(page)

    async def cancel_message_batch(request: Request) -> Response:
        batch_id = request.path_params["batch_id"]
        record = await batch_record(batch_id)
        if message_batches.ended_at_of(record, time.time()) is None:
            await off_loop(batch_store.cancel, batch_id, time.time())
        return await batch_answer(request, batch_id)

    async def message_batch_results(request: Request) -> Response:
        batch_id = request.path_params["batch_id"]
        record = await batch_record(batch_id)
        if message_batches.ended_at_of(record, time.time()) is None:
            raise InvalidRequest(f"message batch {batch_id!r} has not ended yet", "batch_id")
        items = await off_loop(batch_store.params, batch_id)
        body = message_batches.results_jsonl(record, items)
        return Response(body, media_type="application/x-jsonl")

    async def delete_message_batch(request: Request) -> Response:
        batch_id = request.path_params["batch_id"]
        record = await batch_record(batch_id)
        if message_batches.ended_at_of(record, time.time()) is None:
            raise InvalidRequest(
                f"message batch {batch_id!r} is still processing: cancel it first", "batch_id"
            )
        await off_loop(batch_store.delete, batch_id)
        return _json({"id": batch_id, "type": "message_batch_deleted"})

    async def count_message_tokens(request: Request) -> Response:
        body = await decode_body(request, anthropic.CountTokensRequest)
        check_model(body.model)
        return _json({"input_tokens": await off_loop(anthropic.count_tokens, body, model)})

    card = {
        "id": model.name,
        "object": "model",
        "created": model.created,
        "owned_by": "pdcluster",
        "max_model_len": model.max_model_len,
    }

    async def list_models(request: Request) -> Response:
        return _json({"object": "list", "data": [card]})

    async def retrieve_model(request: Request) -> Response:
        check_model(request.path_params["model_id"])
        return _json(card)

    async def version(request: Request) -> Response:
        return _json({"version": importlib.metadata.version("pdcluster")})

    async def tokenize(request: Request) -> Response:
        body = await decode_body(request, TokenizeRequest)
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise InvalidRequest("give exactly one of prompt and messages", "prompt")
        if body.messages is not None:
            as_chat = chat.ChatCompletionRequest(
                model=model.name,
                messages=body.messages,
                add_generation_prompt=body.add_generation_prompt,
                chat_template_kwargs=body.chat_template_kwargs,
            )
            rendered = await off_loop(chat.render_chat, as_chat, model)
            text = rendered.prompt_text
        else:
            text = body.prompt or ""
        model.check_prompt_chars(len(text), "prompt" if body.messages is None else "messages")
        tokens = await off_loop(model.tokenizer.encode, text)
        return _json({"tokens": tokens, "count": len(tokens), "max_model_len": model.max_model_len})

    async def detokenize(request: Request) -> Response:
        body = await decode_body(request, DetokenizeRequest)
        check_model(body.model)
        if any(not 0 <= t < model.vocab_size for t in body.tokens):
            raise InvalidRequest(f"token ids must be in [0, {model.vocab_size})", "tokens")
        text = await off_loop(model.tokenizer.decode, body.tokens, False)
        return _json({"prompt": text})

    async def health(request: Request) -> Response:
        info = await client.cluster_info(HEALTH_TIMEOUT_S)
        if info is None:
            return error_response(503, "the orchestrator does not answer", code="unhealthy")
        ready = {w.role for w in info.workers if w.state == "ready"}
        missing = sorted(needed_roles - ready)
        if missing:
            stalled = [w.worker_id for w in info.workers if w.state == "stalled"]
            detail = f" ({', '.join(stalled)} stalled)" if stalled else ""
            message = f"no live {', '.join(missing)} worker{detail}"
            return error_response(503, message, code="unhealthy")
        return Response(status_code=200)

    async def health_generate(request: Request) -> Response:
        """A one-token request through the whole path: the strongest liveness check."""
        probe = _probe_request(model, client.reply_to)
        queue = await client.submit(probe)
        try:
            event = await asyncio.wait_for(queue.get(), HEALTH_GENERATE_TIMEOUT_S)
        except TimeoutError:
            client.abort(probe.request_id)
            return error_response(
                503, "a one-token request did not finish in time", code="unhealthy"
            )
        client.done(probe.request_id)
        if not isinstance(event, Chunk) or event.status_code != 200:
            return error_response(503, "a one-token request failed", code="unhealthy")
        return Response(status_code=200)

    async def cluster_info(request: Request) -> Response:
        info = await client.cluster_info(HEALTH_TIMEOUT_S)
        if info is None:
            return error_response(503, "the orchestrator does not answer", code="unhealthy")
        return Response(msgspec.json.encode(info), media_type="application/json")

    async def server_info(request: Request) -> Response:
        """What a client or a router needs to know about this deployment (the seed's
        /server_info): the model and how the cluster is set up, its workers by role."""
        info = await client.cluster_info(HEALTH_TIMEOUT_S)
        roles: dict[str, list[str]] = {}
        for worker in info.workers if info is not None else []:
            if worker.state != "dead":
                roles.setdefault(worker.role, []).append(worker.worker_id)
        return _json({
            "model": model.name, "max_model_len": model.max_model_len, "dtype": config.dtype,
            "device": config.device, "mode": config.mode,
            "kv_cache": {"block_size": config.kv_cache.block_size,
                         "hash_algorithm": HASH_ALGORITHM},
            "protocol_version": PROTOCOL_VERSION,
            "version": importlib.metadata.version("pdcluster"),
            "roles": roles, "endpoints": sorted(ROUTES),
        })  # fmt: skip

    async def kv_cache_events(request: Request) -> Response:
        """Drains the cluster's KV-event queue (TensorRT-LLM's shape); a router polls it."""
        drained = await client.drain_kv_events(HEALTH_TIMEOUT_S)
        if drained is None:
            return error_response(503, "the orchestrator does not answer", code="unhealthy")
        return Response(drained.events_json, media_type="application/json")

    async def start_profile(request: Request) -> Response:
        return await profile_response(config, client, "start")

    async def stop_profile(request: Request) -> Response:
        return await profile_response(config, client, "stop")

    async def prometheus_metrics(request: Request) -> Response:
        info = await client.cluster_info(HEALTH_TIMEOUT_S)
        return Response(metrics.render(info), media_type=CONTENT_TYPE_LATEST)

    async def openapi(request: Request) -> Response:
        return _json(openapi_document())

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await client.start()
        try:
            yield
        finally:
            await batches.close()
            await client.close()

    routes = [
        Route("/v1/completions", create_completion, methods=["POST"]),
        Route("/v1/chat/completions", create_chat_completion, methods=["POST"]),
        Route("/v1/embeddings", create_embedding, methods=["POST"]),
        Route("/v1/messages", create_message, methods=["POST"]),
        Route("/v1/responses", create_response, methods=["POST"]),
        Route("/v1/responses/{response_id}", retrieve_response, methods=["GET"]),
        Route("/v1/responses/{response_id}", delete_response, methods=["DELETE"]),
        Route("/v1/messages/count_tokens", count_message_tokens, methods=["POST"]),
        Route("/v1/messages/batches", create_message_batch, methods=["POST"]),
        Route("/v1/messages/batches", list_message_batches, methods=["GET"]),
        Route("/v1/messages/batches/{batch_id}", retrieve_message_batch, methods=["GET"]),
        Route("/v1/messages/batches/{batch_id}", delete_message_batch, methods=["DELETE"]),
        Route("/v1/messages/batches/{batch_id}/cancel", cancel_message_batch, methods=["POST"]),
        Route("/v1/messages/batches/{batch_id}/results", message_batch_results, methods=["GET"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", retrieve_model, methods=["GET"]),
        Route("/v1/tokenize", tokenize, methods=["POST"]),
        Route("/v1/detokenize", detokenize, methods=["POST"]),
        Route("/version", version, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/health_generate", health_generate, methods=["GET"]),
        Route("/cluster_info", cluster_info, methods=["GET"]),
        Route("/server_info", server_info, methods=["GET"]),
        Route("/kv_cache_events", kv_cache_events, methods=["POST"]),
        Route("/start_profile", start_profile, methods=["POST"]),
        Route("/stop_profile", stop_profile, methods=["POST"]),
        Route("/metrics", prometheus_metrics, methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"]),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={
            InvalidRequest: _invalid_request,
            HTTPException: _http_exception,
            Exception: _server_error,
        },
    )
    if config.frontend.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=config.frontend.api_key)
    app.add_middleware(metrics.RequestCounter, routes=frozenset(r.path for r in routes))
    return app


class _NotFound(InvalidRequest):
    def __init__(self, message: str, param: str, code: str) -> None:
        super().__init__(message, param)
        self.code = code


async def _invalid_request(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, InvalidRequest)
    media = media_of(request.url.path)
    if isinstance(exc, _NotFound):
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


def responses_format_final(frame: bytes) -> bytes | None:
    """The Response JSON in a stream's final event (response.completed / .incomplete), if
    `frame` holds it."""
    for marker in (b"event: response.completed\ndata: ", b"event: response.incomplete\ndata: "):
        start = frame.find(marker)
        if start >= 0:
            event = msgspec.json.decode(frame[start + len(marker) :].split(b"\n", 1)[0])
            return msgspec.json.encode(event["response"])
    return None


def _json(payload: object) -> Response:
    return Response(msgspec.json.encode(payload), media_type="application/json")


def _probe_request(model: ModelInfo, reply_to: str) -> GenerateRequest:
    prompt_b64 = encode_token_ids(model.tokenizer.encode("ok") or [0])
    return GenerateRequest(
        request_id=completions.new_request_id("health"),
        prompt_token_ids_b64=prompt_b64,
        sampling=SamplingParams(max_tokens=1, temperature=0.0),
        output=OutputOptions(model=model.name),
        reply_to=reply_to,
    )


def _param_of(message: str) -> str | None:
    """The request field a msgspec message points at (or the unknown field it names)."""
    _, path = validation_location(message)
    if path is not None:
        return path.split("[")[0]
    if message.startswith("Object contains unknown field `"):
        return message.split("`")[1]
    return None
