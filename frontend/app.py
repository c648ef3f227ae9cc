"""The HTTP surface (starlette): validate, translate, hand the request to the cluster, relay
the postproc workers' bytes. Errors all have the one OpenAI shape (`common.errors.error_body`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from common.config import ClusterConfig
from common.errors import InvalidRequest, error_body
from common.protocol import Chunk, GenerateRequest, RequestFailed
from common.tokenizer import Tokenizer, load_tokenizer, resolve_model_dir
from frontend.cluster_client import ClusterClient, Event
from frontend.completions import CompletionRequest, to_generate_request

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
HEALTH_TIMEOUT_S = 1.0


@dataclass(slots=True)
class ModelInfo:
    name: str
    tokenizer: Tokenizer
    max_model_len: int
    vocab_size: int


def load_model_info(config: ClusterConfig) -> ModelInfo:
    model_dir = resolve_model_dir(config.model)
    hf_config = json.loads((model_dir / "config.json").read_text())
    return ModelInfo(
        name=config.model,
        tokenizer=load_tokenizer(model_dir),
        max_model_len=int(hf_config["max_position_embeddings"]),
        vocab_size=int(hf_config["vocab_size"]),
    )


def error_response(
    status_code: int, message: str, param: str | None = None, code: str | None = None
) -> Response:
    return Response(
        error_body(status_code, message, param, code), status_code, media_type="application/json"
    )


def build_app(config: ClusterConfig, client: ClusterClient, model: ModelInfo) -> Starlette:
    needed_roles = {"generation", "postproc"} | (
        {"context"} if config.mode == "disaggregated" else set()
    )

    async def completions(request: Request) -> Response:
        try:
            body = msgspec.json.decode(await request.body(), type=CompletionRequest)
        except msgspec.ValidationError as e:
            return error_response(400, str(e), _param_of(str(e)))
        except msgspec.DecodeError as e:
            return error_response(400, f"the body is not valid JSON: {e}")
        if body.model != model.name:
            return error_response(
                404, f"the model {body.model!r} does not exist", "model", "model_not_found"
            )
        try:
            generate = await asyncio.to_thread(
                to_generate_request,
                body,
                model.tokenizer,
                model.max_model_len,
                model.vocab_size,
                client.reply_to,
            )
        except InvalidRequest as e:
            return error_response(400, e.message, e.param)
        return await serve(request, generate)

    async def serve(request: Request, generate: GenerateRequest) -> Response:
        request_id = generate.request_id
        queue = await client.submit(generate)
        first = await _next_or_disconnect(queue, request)
        if first is None:
            client.abort(request_id)
            return Response(status_code=499)
        failure = _failure(first)
        if failure is not None:
            client.done(request_id)
            return failure
        assert isinstance(first, Chunk)
        if not generate.output.stream:
            client.done(request_id)
            return Response(first.data, media_type="application/json")
        if first.done:
            client.done(request_id)
        return StreamingResponse(
            _relay(client, request_id, first, queue),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )

    async def health(request: Request) -> Response:
        info = await client.cluster_info(HEALTH_TIMEOUT_S)
        if info is None:
            return error_response(503, "the orchestrator does not answer", code="unhealthy")
        ready = {w.role for w in info.workers if w.state == "ready"}
        missing = sorted(needed_roles - ready)
        if missing:
            return error_response(503, f"no live {', '.join(missing)} worker", code="unhealthy")
        return Response(status_code=200)

    async def cluster_info(request: Request) -> Response:
        info = await client.cluster_info(HEALTH_TIMEOUT_S)
        if info is None:
            return error_response(503, "the orchestrator does not answer", code="unhealthy")
        return Response(msgspec.json.encode(info), media_type="application/json")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await client.start()
        try:
            yield
        finally:
            await client.close()

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/cluster_info", cluster_info, methods=["GET"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan)


def _failure(event: Event) -> Response | None:
    if isinstance(event, RequestFailed):
        return error_response(event.status_code, event.message, event.param, event.code)
    if event.status_code != 200:
        return Response(event.data, event.status_code, media_type="application/json")
    return None


async def _relay(
    client: ClusterClient, request_id: str, first: Chunk, queue: asyncio.Queue[Event]
) -> AsyncIterator[bytes]:
    """SSE bytes until the request is done; an error after the stream started is sent as a final
    `data: {"error": ...}` frame and [DONE]. A client that leaves aborts the request."""
    finished = False
    try:
        event: Event = first
        while True:
            if isinstance(event, RequestFailed) or event.status_code != 200:
                body = (
                    error_body(event.status_code, event.message, event.param, event.code)
                    if isinstance(event, RequestFailed)
                    else event.data
                )
                finished = True
                yield b"data: " + body + b"\n\ndata: [DONE]\n\n"
                return
            if event.data:
                yield event.data
            if event.done:
                finished = True
                return
            event = await queue.get()
    finally:
        if finished:
            client.done(request_id)
        else:
            client.abort(request_id)


async def _next_or_disconnect(queue: asyncio.Queue[Event], request: Request) -> Event | None:
    """The request's next event, or None if the client disconnects first."""
    get = asyncio.ensure_future(queue.get())
    disconnect = asyncio.ensure_future(_disconnected(request))
    done, pending = await asyncio.wait({get, disconnect}, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    return get.result() if get in done else None


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _param_of(message: str) -> str | None:
    """msgspec ends its messages with `- at `$.field``: that field is the param."""
    _, sep, where = message.rpartition(" - at `$.")
    return where.rstrip("`").split("[")[0] if sep else None
