"""The seed's internal render / generate routes (TensorRT-LLM's serve/render), mounted only with
`frontend.render_endpoints: true` (off by default: a separate surface, for a router in front of
the cluster that wants prompt token ids, e.g. to hash blocks, without running a request):

    POST /v1/chat/completions/render  a chat body → a prepared request: the prompt's token ids as
                                      the chat route would run them, and the body itself
    POST /v1/completions/render       a completions body → one prepared request per prompt
    POST /generate                    a prepared request → run by its route with the ids as the
                                      prompt (chat: prompt_token_ids, so the template is not
                                      rendered again); the answer is that route's

A prepared request is the seed's GenerateRequest: schema_version, kind, fingerprint (a digest
of what turns a request into ids here: tokenizer, chat template, tool format, model type,
version), token_ids, tokens_trusted (false for a named tool_choice whose opening the chat route
appends after the template: ids with it cannot be run as a prompt), context (the thinking state
read off the rendered prompt, the tokens not billed), request. /generate refuses another
schema_version or untrusted ids (400) and ids rendered under another fingerprint (409).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from functools import cache
from pathlib import Path
from typing import Any, Literal

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from common.errors import InvalidRequest
from common.protocol import GenerateRequest, decode_token_ids
from frontend import chat, completions
from frontend.endpoint import decode_body, json_response, param_of, state_of, translate
from frontend.generation import error_response
from frontend.lora import lora_for
from frontend.model_info import ModelInfo
from frontend.openai_routes import serve_chat, serve_completion

SCHEMA_VERSION = 1
GATEWAY_FIELDS = ("nvext", "cache_namespace")  # a gateway's own fields, never the prompt's


class PreparedContext(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    prompt_tokens_excluded_from_usage: int = 0
    resolved_thinking: bool | None = None


class PreparedRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    fingerprint: dict[str, Any]
    token_ids: list[int]
    schema_version: int = SCHEMA_VERSION
    kind: Literal["chat", "completion"] = "chat"
    tokens_trusted: bool = True
    untrusted_reason: str | None = None
    context: PreparedContext = msgspec.field(default_factory=PreparedContext)
    request: dict[str, Any] = msgspec.field(default_factory=dict)


def fingerprint(model: ModelInfo) -> dict[str, Any]:
    """What decides the ids a request renders to here, and its digest (a router compares it
    with the cluster's before trusting ids rendered elsewhere)."""
    return _fingerprint(
        str(model.model_dir),
        model.model_type,
        model.harmony,
        model.tool_parser,  # tools a template ignores are written in its format
        model.tokenizer.chat_template or "",
    )


@cache
def _fingerprint(
    model_dir: str, model_type: str, harmony: bool, tool_parser: str, chat_template: str
) -> dict[str, Any]:
    tokenizer_file = Path(model_dir) / "tokenizer.json"
    compared = {
        "version": SCHEMA_VERSION,
        "pdcluster": importlib.metadata.version("pdcluster"),
        "model_type": model_type,
        "harmony": harmony,
        "tool_parser": tool_parser,
        "tokenizer_sha256": _sha256(tokenizer_file.read_bytes())
        if tokenizer_file.is_file()
        else None,
        "chat_template_sha256": _sha256(chat_template.encode()),
    }
    digest = _sha256(json.dumps(compared, sort_keys=True).encode())
    return {"digest": digest, "compared": compared}


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


async def _raw_body(request: Request) -> dict[str, Any]:
    body = await decode_body(request, dict[str, Any])
    return {k: v for k, v in body.items() if k not in GATEWAY_FIELDS}


def _convert(raw: dict[str, Any], schema: type[Any]) -> Any:
    try:
        return msgspec.convert(raw, schema)
    except msgspec.ValidationError as e:
        raise InvalidRequest(str(e), param_of(str(e))) from None


def _prepared(
    kind: Literal["chat", "completion"],
    generate: GenerateRequest,
    request: dict[str, Any],
    model: ModelInfo,
) -> PreparedRequest:
    output = generate.output
    excluded = output.prompt_tokens_excluded
    parser = output.parser_state
    return PreparedRequest(
        kind=kind,
        fingerprint=fingerprint(model),
        token_ids=decode_token_ids(generate.prompt_token_ids_b64),
        tokens_trusted=excluded == 0,
        untrusted_reason=None
        if excluded == 0
        else "a named tool_choice: the ids end with the call's opening, appended after the "
        "template; send the original request",
        context=PreparedContext(
            prompt_tokens_excluded_from_usage=excluded,
            resolved_thinking=parser.thinking if parser is not None else None,
        ),
        request=request,
    )


async def render_chat(request: Request) -> Response:
    state = state_of(request)
    raw = await _raw_body(request)
    body = _convert(raw, chat.ChatCompletionRequest)
    await lora_for(state, body.model, body.lora_request)
    allow = state.config.frontend.allow_request_chat_template
    (generate,) = await translate(
        lambda: [chat.to_generate_request(body, state.model, state.client.reply_to, allow)]
    )
    return json_response(_prepared("chat", generate, raw, state.model))


async def render_completions(request: Request) -> Response:
    state = state_of(request)
    raw = await _raw_body(request)
    body = _convert(raw, completions.CompletionRequest)
    await lora_for(state, body.model, body.lora_request)
    generates = await translate(
        completions.to_generate_requests, body, state.model, state.client.reply_to
    )
    prepared = []
    for generate in generates:
        ids = decode_token_ids(generate.prompt_token_ids_b64)
        one = {**raw, "prompt": ids}
        one.pop("prompt_token_ids_b64", None)
        prepared.append(_prepared("completion", generate, one, state.model))
    return json_response(prepared)


async def generate(request: Request) -> Response:
    state = state_of(request)
    prepared = await decode_body(request, PreparedRequest)
    if prepared.schema_version != SCHEMA_VERSION:
        raise InvalidRequest(
            f"schema_version {prepared.schema_version} is not {SCHEMA_VERSION}, the one this "
            "server reads",
            "schema_version",
        )
    if not prepared.tokens_trusted:
        why = prepared.untrusted_reason or "no reason given"
        raise InvalidRequest(
            f"the prepared token ids are not trusted ({why}): send the original request to its "
            "route",
            "tokens_trusted",
        )
    if prepared.fingerprint.get("digest") != fingerprint(state.model)["digest"]:
        return error_response(
            409,
            "the ids were rendered under another configuration (tokenizer, chat template, tool "
            "format, model type or version) than this server's: send the original request",
            "fingerprint",
            code="fingerprint_mismatch",
        )
    if prepared.kind == "chat":
        raw = {**prepared.request, "prompt_token_ids": prepared.token_ids}
        raw.pop("prompt_token_ids_b64", None)
        return await serve_chat(request, _convert(raw, chat.ChatCompletionRequest))
    raw = {**prepared.request, "prompt": prepared.token_ids}
    raw.pop("prompt_token_ids_b64", None)
    return await serve_completion(request, _convert(raw, completions.CompletionRequest))


ROUTES = [
    Route("/v1/chat/completions/render", render_chat, methods=["POST"]),
    Route("/v1/completions/render", render_completions, methods=["POST"]),
    Route("/generate", generate, methods=["POST"]),
]
