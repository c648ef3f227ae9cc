"""The OpenAI Responses API: POST /v1/responses (continuing a stored conversation when the
request names `previous_response_id`), and GET / DELETE of stored responses.

A stored response is its final Response JSON and the conversation that led to it; a streamed
one is stored when its final event (completed or incomplete) goes by.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from frontend import chat, responses
from frontend.endpoint import (
    NotFound,
    decode_body,
    json_response,
    off_loop,
    state_of,
    translate,
)
from frontend.generation import serve
from frontend.images import with_images
from frontend.lora import lora_of, with_lora
from frontend.response_store import ResponseStore


async def create_response(request: Request) -> Response:
    state = state_of(request)
    store = state.response_store
    body = await decode_body(request, responses.ResponsesRequest)
    lora_name = await lora_of(state, body.model)
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        stored = await off_loop(store.get, body.previous_response_id)
        if stored is None:
            raise NotFound(f"no stored response {body.previous_response_id!r}",
                           "previous_response_id", "response_not_found")  # fmt: skip
        history = stored[1]
    reply_to, harmony = state.client.reply_to, state.model.harmony
    urls = chat.image_urls(responses.as_chat_request(body, history, harmony).messages)
    generates = await with_images(
        translate(lambda: [responses.to_generate_request(body, history, state.model, reply_to)]),
        urls,
        state.model.vision,
    )
    generates = with_lora(generates, lora_name)
    timeout_s = state.config.frontend.request_timeout_seconds
    answer = await serve(request, state.client, generates, media="responses", timeout_s=timeout_s)
    if not body.store or answer.status_code != 200:
        return answer
    turns = [*history, *responses.input_messages(body.input, keep_reasoning=state.model.harmony)]
    if isinstance(answer, StreamingResponse):
        answer.body_iterator = _store_when_done(store, answer.body_iterator, turns)
    else:
        await off_loop(store.put, bytes(answer.body), turns)
    return answer


async def retrieve_response(request: Request) -> Response:
    store = state_of(request).response_store
    stored = await off_loop(store.get, request.path_params["response_id"])
    if stored is None:
        raise NotFound("no such stored response", "response_id", "response_not_found")
    return Response(stored[0], media_type="application/json")


async def delete_response(request: Request) -> Response:
    store = state_of(request).response_store
    response_id = request.path_params["response_id"]
    if not await off_loop(store.delete, response_id):
        raise NotFound("no such stored response", "response_id", "response_not_found")
    return json_response({"id": response_id, "object": "response.deleted", "deleted": True})


async def _store_when_done(
    store: ResponseStore, frames: Any, turns: list[dict[str, Any]]
) -> AsyncIterator[Any]:
    """Relay a response's events; the final one (completed or incomplete) is stored."""
    async for frame in frames:
        yield frame
        final = final_response(frame)
        if final is not None:
            await off_loop(store.put, final, turns)


def final_response(frame: bytes) -> bytes | None:
    """The Response JSON in a stream's final event (response.completed / .incomplete), if
    `frame` holds it."""
    for marker in (b"event: response.completed\ndata: ", b"event: response.incomplete\ndata: "):
        start = frame.find(marker)
        if start >= 0:
            event = msgspec.json.decode(frame[start + len(marker) :].split(b"\n", 1)[0])
            return msgspec.json.encode(event["response"])
    return None
