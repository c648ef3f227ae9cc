"""The OpenAI generation endpoints: POST /v1/completions, /v1/chat/completions and
/v1/embeddings. Each decodes its body, translates it off the loop and hands it to `serve`;
`serve_completion` and `serve_chat` also run a prepared request of POST /generate
(frontend/render_routes.py)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from frontend import chat, completions, embeddings
from frontend.endpoint import decode_body, state_of, translate
from frontend.generation import serve
from frontend.images import with_images
from frontend.lora import lora_for, lora_of, with_lora


async def create_completion(request: Request) -> Response:
    body = await decode_body(request, completions.CompletionRequest)
    return await serve_completion(request, body)


async def serve_completion(request: Request, body: completions.CompletionRequest) -> Response:
    state = state_of(request)
    lora_name = await lora_for(state, body.model, body.lora_request)
    generates = await translate(
        completions.to_generate_requests, body, state.model, state.client.reply_to
    )
    generates = with_lora(generates, lora_name)
    timeout_s = state.config.frontend.request_timeout_seconds
    return await serve(request, state.client, generates, timeout_s=timeout_s)


async def create_chat_completion(request: Request) -> Response:
    body = await decode_body(request, chat.ChatCompletionRequest)
    return await serve_chat(request, body)


async def serve_chat(request: Request, body: chat.ChatCompletionRequest) -> Response:
    state = state_of(request)
    lora_name = await lora_for(state, body.model, body.lora_request)
    allow_template = state.config.frontend.allow_request_chat_template
    urls = chat.image_urls(body.messages)
    generates = await with_images(
        translate(
            lambda: [
                chat.to_generate_request(body, state.model, state.client.reply_to, allow_template)
            ]
        ),
        urls,
        state.model.vision,
    )
    generates = with_lora(generates, lora_name)
    timeout_s = state.config.frontend.request_timeout_seconds
    return await serve(request, state.client, generates, timeout_s=timeout_s)


async def create_embedding(request: Request) -> Response:
    state = state_of(request)
    body = await decode_body(request, embeddings.EmbeddingRequest)
    lora_name = await lora_of(state, body.model)
    generates = await translate(
        embeddings.to_generate_requests, body, state.model, state.client.reply_to
    )
    generates = with_lora(generates, lora_name)
    timeout_s = state.config.frontend.request_timeout_seconds
    return await serve(request, state.client, generates, timeout_s=timeout_s)
