"""The endpoints around generation: the model list, tokenize / detokenize, version, health
(the orchestrator's table, or a one-token request through the whole path), what the cluster
is, its KV events, the profiler, Prometheus metrics and the OpenAPI document."""

from __future__ import annotations

import asyncio
import importlib.metadata

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import Response

from common.block_hash import HASH_ALGORITHM
from common.errors import InvalidRequest
from common.protocol import (
    PROTOCOL_VERSION,
    Chunk,
    GenerateRequest,
    OutputOptions,
    encode_token_ids,
)
from common.sampling_params import SamplingParams
from frontend import chat, completions, lora, metrics
from frontend.endpoint import check_model, decode_body, json_response, off_loop, state_of
from frontend.generation import error_response
from frontend.model_info import ModelInfo
from frontend.openapi import ROUTES, openapi_document
from frontend.profiling import profile_response
from frontend.tokenize_schema import DetokenizeRequest, TokenizeRequest

HEALTH_TIMEOUT_S = 1.0
HEALTH_GENERATE_TIMEOUT_S = 30.0


# --- the model and its tokenizer ------------------------------------------------------------------


def model_card(model: ModelInfo) -> dict[str, object]:
    return {
        "id": model.name,
        "object": "model",
        "created": model.created,
        "owned_by": "pdcluster",
        "max_model_len": model.max_model_len,
    }


async def list_models(request: Request) -> Response:
    """The base model, then each LoRA adapter with the base as its `parent` (vLLM's shape)."""
    state = state_of(request)
    await lora.refresh_adapters(state)
    cards = [model_card(state.model), *lora.adapter_cards(state)]
    return json_response({"object": "list", "data": cards})


async def retrieve_model(request: Request) -> Response:
    state = state_of(request)
    name = request.path_params["model_id"]
    if await lora.lora_of(state, name) is not None:
        return json_response(next(c for c in lora.adapter_cards(state) if c["id"] == name))
    return json_response(model_card(state.model))


async def tokenize(request: Request) -> Response:
    model = state_of(request).model
    body = await decode_body(request, TokenizeRequest)
    check_model(model, body.model)
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
    return json_response(
        {"tokens": tokens, "count": len(tokens), "max_model_len": model.max_model_len}
    )


async def detokenize(request: Request) -> Response:
    model = state_of(request).model
    body = await decode_body(request, DetokenizeRequest)
    check_model(model, body.model)
    if any(not 0 <= t < model.vocab_size for t in body.tokens):
        raise InvalidRequest(f"token ids must be in [0, {model.vocab_size})", "tokens")
    text = await off_loop(model.tokenizer.decode, body.tokens, False)
    return json_response({"prompt": text})


async def version(request: Request) -> Response:
    return json_response({"version": importlib.metadata.version("pdcluster")})


# --- health and what the cluster is ---------------------------------------------------------------


async def health(request: Request) -> Response:
    """200 when the orchestrator answers and every role this mode needs has a ready worker."""
    state = state_of(request)
    needed_roles = {"generation", "postproc"} | (
        {"context"} if state.config.mode == "disaggregated" else set()
    )
    info = await state.client.cluster_info(HEALTH_TIMEOUT_S)
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
    state = state_of(request)
    client = state.client
    probe = _probe_request(state.model, client.reply_to)
    queue = await client.submit(probe)
    try:
        event = await asyncio.wait_for(queue.get(), HEALTH_GENERATE_TIMEOUT_S)
    except TimeoutError:
        client.abort(probe.request_id)
        return error_response(503, "a one-token request did not finish in time", code="unhealthy")
    client.done(probe.request_id)
    if not isinstance(event, Chunk) or event.status_code != 200:
        return error_response(503, "a one-token request failed", code="unhealthy")
    return Response(status_code=200)


async def cluster_info(request: Request) -> Response:
    info = await state_of(request).client.cluster_info(HEALTH_TIMEOUT_S)
    if info is None:
        return error_response(503, "the orchestrator does not answer", code="unhealthy")
    return Response(msgspec.json.encode(info), media_type="application/json")


async def server_info(request: Request) -> Response:
    """What a client or a router needs to know about this deployment (the seed's
    /server_info): the model and how the cluster is set up, its workers by role."""
    state = state_of(request)
    config, model = state.config, state.model
    info = await state.client.cluster_info(HEALTH_TIMEOUT_S)
    roles: dict[str, list[str]] = {}
    for worker in info.workers if info is not None else []:
        if worker.state != "dead":
            roles.setdefault(worker.role, []).append(worker.worker_id)
    return json_response({
        "model": model.name, "max_model_len": model.max_model_len, "dtype": config.dtype,
        "device": config.device, "mode": config.mode,
        "kv_cache": {"block_size": config.kv_cache.block_size, "hash_algorithm": HASH_ALGORITHM},
        "protocol_version": PROTOCOL_VERSION,
        "version": importlib.metadata.version("pdcluster"),
        "roles": roles, "endpoints": sorted(ROUTES),
    })  # fmt: skip


async def kv_cache_events(request: Request) -> Response:
    """Drains the cluster's KV-event queue (TensorRT-LLM's shape); a router polls it."""
    drained = await state_of(request).client.drain_kv_events(HEALTH_TIMEOUT_S)
    if drained is None:
        return error_response(503, "the orchestrator does not answer", code="unhealthy")
    return Response(drained.events_json, media_type="application/json")


# --- operators' tools -----------------------------------------------------------------------------


async def start_profile(request: Request) -> Response:
    state = state_of(request)
    return await profile_response(state.config, state.client, "start")


async def stop_profile(request: Request) -> Response:
    state = state_of(request)
    return await profile_response(state.config, state.client, "stop")


async def prometheus_metrics(request: Request) -> Response:
    info = await state_of(request).client.cluster_info(HEALTH_TIMEOUT_S)
    return Response(metrics.render(info), media_type=CONTENT_TYPE_LATEST)


async def openapi(request: Request) -> Response:
    return json_response(openapi_document())


def _probe_request(model: ModelInfo, reply_to: str) -> GenerateRequest:
    prompt_b64 = encode_token_ids(model.tokenizer.encode("ok") or [0])
    return GenerateRequest(
        request_id=completions.new_request_id("health"),
        prompt_token_ids_b64=prompt_b64,
        sampling=SamplingParams(max_tokens=1, temperature=0.0),
        output=OutputOptions(model=model.name),
        reply_to=reply_to,
    )
