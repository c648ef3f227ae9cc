"""The Anthropic endpoints: POST /v1/messages and /v1/messages/count_tokens, and the Message
Batches API under /v1/messages/batches (a batch runs in the process that created it, any
process answers for it: they share `frontend.responses_store`). Errors on these routes take
Anthropic's shape (frontend/app.py's `media_of`)."""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import Response

from common.errors import InvalidRequest
from frontend import anthropic, chat, message_batches
from frontend.batch_store import BatchRecord
from frontend.endpoint import (
    FrontendState,
    NotFound,
    check_model,
    decode_body,
    json_response,
    off_loop,
    state_of,
    translate,
)
from frontend.generation import serve
from frontend.images import with_images
from frontend.lora import lora_of, with_lora


async def create_message(request: Request) -> Response:
    state = state_of(request)
    body = await decode_body(request, anthropic.MessagesRequest)
    lora_name = await lora_of(state, body.model)
    reply_to = state.client.reply_to
    urls = chat.image_urls(anthropic.as_chat(body).messages)
    generates = await with_images(
        translate(lambda: [anthropic.to_generate_request(body, state.model, reply_to)]),
        urls,
        state.model.vision,
    )
    generates = with_lora(generates, lora_name)
    timeout_s = state.config.frontend.request_timeout_seconds
    return await serve(request, state.client, generates, media="anthropic", timeout_s=timeout_s)


async def count_message_tokens(request: Request) -> Response:
    state = state_of(request)
    body = await decode_body(request, anthropic.CountTokensRequest)
    check_model(state.model, body.model)
    return json_response(
        {"input_tokens": await off_loop(anthropic.count_tokens, body, state.model)}
    )


# --- Message Batches ------------------------------------------------------------------------------


async def create_message_batch(request: Request) -> Response:
    state = state_of(request)
    body = await decode_body(request, message_batches.CreateBatchRequest)
    for item in body.requests:
        check_model(state.model, item.params.model)
    items = message_batches.parse_items(body)
    batch_id = message_batches.new_batch_id()
    await off_loop(state.batch_store.create, batch_id, time.time(), items)
    state.batches.start(batch_id, items)
    return await _batch_answer(request, state, batch_id)


async def retrieve_message_batch(request: Request) -> Response:
    return await _batch_answer(request, state_of(request), request.path_params["batch_id"])


async def list_message_batches(request: Request) -> Response:
    store = state_of(request).batch_store
    query = request.query_params
    limit = query.get("limit", "20")
    if not limit.isdigit() or not 1 <= int(limit) <= 1000:
        raise InvalidRequest("limit must be an integer from 1 to 1000", "limit")
    records = await off_loop(lambda: [r for r in map(store.get, store.ids()) if r is not None])
    now, base = time.time(), str(request.base_url)
    views = [message_batches.view(r, base, now) for r in records]
    page = message_batches.page(views, int(limit), query.get("after_id"), query.get("before_id"))
    return json_response(page)


async def cancel_message_batch(request: Request) -> Response:
    state = state_of(request)
    batch_id = request.path_params["batch_id"]
    record = await _batch_record(state, batch_id)
    if message_batches.ended_at_of(record, time.time()) is None:
        await off_loop(state.batch_store.cancel, batch_id, time.time())
    return await _batch_answer(request, state, batch_id)


async def message_batch_results(request: Request) -> Response:
    state = state_of(request)
    batch_id = request.path_params["batch_id"]
    record = await _batch_record(state, batch_id)
    if message_batches.ended_at_of(record, time.time()) is None:
        raise InvalidRequest(f"message batch {batch_id!r} has not ended yet", "batch_id")
    items = await off_loop(state.batch_store.params, batch_id)
    body = message_batches.results_jsonl(record, items)
    return Response(body, media_type="application/x-jsonl")


async def delete_message_batch(request: Request) -> Response:
    state = state_of(request)
    batch_id = request.path_params["batch_id"]
    record = await _batch_record(state, batch_id)
    if message_batches.ended_at_of(record, time.time()) is None:
        raise InvalidRequest(
            f"message batch {batch_id!r} is still processing: cancel it first", "batch_id"
        )
    await off_loop(state.batch_store.delete, batch_id)
    return json_response({"id": batch_id, "type": "message_batch_deleted"})


async def _batch_record(state: FrontendState, batch_id: str) -> BatchRecord:
    record = await off_loop(state.batch_store.get, batch_id)
    if record is None:
        raise NotFound(f"no message batch {batch_id!r}", "batch_id", "not_found_error")
    return record


async def _batch_answer(request: Request, state: FrontendState, batch_id: str) -> Response:
    record = await _batch_record(state, batch_id)
    return json_response(message_batches.view(record, str(request.base_url), time.time()))
