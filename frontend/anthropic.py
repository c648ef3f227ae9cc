"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API on the same cluster.

The request becomes a chat conversation (system prompt first), is rendered with the model's chat
template like any chat request, and goes out with OutputOptions.kind "anthropic": the postproc
worker formats Anthropic's message body or its streaming events. Text content only for now;
tool_use / tool_result blocks come with the tool-calling issue and are a 400 until then.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

import msgspec

from common.errors import InvalidRequest
from common.protocol import GenerateRequest, OutputOptions, encode_token_ids
from common.sampling_params import SamplingParams
from common.tokenizer import Tokenizer
from frontend.chat import ChatCompletionRequest, ImagePart, Message, TextPart, render_chat
from frontend.model_info import ModelInfo
from frontend.sampling import max_tokens_for, stop_list


class _Strict(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class TextBlock(_Strict, tag_field="type", tag="text"):
    text: str
    cache_control: dict[str, Any] | None = None


class AnthropicMessage(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[TextBlock]


class MessagesRequest(_Strict):
    model: str
    max_tokens: int
    messages: list[AnthropicMessage]
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None  # accepted, not used
    service_tier: str | None = None  # accepted, not used
    # extensions (older versions of the API had them): sampling controls
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0


class CountTokensRequest(_Strict):
    model: str
    messages: list[AnthropicMessage]
    system: str | list[TextBlock] | None = None


def as_chat(
    model: str, messages: list[AnthropicMessage], system: str | list[TextBlock] | None
) -> ChatCompletionRequest:
    if not messages:
        raise InvalidRequest("messages must not be empty", "messages")
    chat_messages = []
    if system:
        text = system if isinstance(system, str) else "\n".join(b.text for b in system)
        chat_messages.append(Message(role="system", content=text))
    for m in messages:
        content: str | list[TextPart | ImagePart] = (
            m.content if isinstance(m.content, str) else [TextPart(text=b.text) for b in m.content]
        )
        chat_messages.append(Message(role=m.role, content=content))
    return ChatCompletionRequest(model=model, messages=chat_messages)


def count_tokens(body: CountTokensRequest, tokenizer: Tokenizer) -> int:
    rendered = render_chat(
        as_chat(body.model, body.messages, body.system), tokenizer, tokenizer.chat_template
    )
    return len(tokenizer.encode(rendered.prompt_text))


def to_generate_request(body: MessagesRequest, model: ModelInfo, reply_to: str) -> GenerateRequest:
    tokenizer, vocab_size, max_model_len = model.tokenizer, model.vocab_size, model.max_model_len
    chat = as_chat(body.model, body.messages, body.system)
    # Anthropic's own ranges: temperature in [0, 1]
    if not 0.0 <= body.temperature <= 1.0:
        raise InvalidRequest(
            f"temperature must be in [0, 1], got {body.temperature}", "temperature"
        )
    prompt = tokenizer.encode(render_chat(chat, tokenizer, tokenizer.chat_template).prompt_text)
    stops = stop_list(body.stop_sequences)
    sampling = SamplingParams(
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        stop=stops,
        max_tokens=max_tokens_for(body.max_tokens, len(prompt), max_model_len),
    )
    sampling.validate(vocab_size)
    prompt_b64 = encode_token_ids(prompt)
    output = OutputOptions(
        kind="anthropic",
        model=body.model,
        created=int(time.time()),
        stream=body.stream,
        stop=stops,
        prompt_token_ids_b64=prompt_b64,
    )
    return GenerateRequest(
        request_id=f"msg_{uuid.uuid4().hex}",  # Anthropic's id style
        prompt_token_ids_b64=prompt_b64,
        sampling=sampling,
        output=output,
        reply_to=reply_to,
        arrival_time=time.time(),
    )
