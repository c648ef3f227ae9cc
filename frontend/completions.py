"""POST /v1/completions: the request body, and its translation into a GenerateRequest.

The body is decoded strictly (unknown fields are a 400, as the frontend issue requires); the
defaults are OpenAI's. The frontend issue widens this to the full surface (prompt lists, base64
ids, best_of, ...).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated

import msgspec

from common.errors import InvalidRequest
from common.protocol import GenerateRequest, OutputOptions, encode_token_ids
from common.sampling_params import SamplingParams
from common.tokenizer import Tokenizer

NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    include_usage: bool = False


class CompletionRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str
    prompt: str | list[NonNegative]
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: int | None = None
    echo: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    # extensions, as in vLLM
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    cache_salt: str | None = None
    priority: int = 0


def new_request_id(prefix: str = "cmpl") -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def to_generate_request(
    body: CompletionRequest,
    tokenizer: Tokenizer,
    max_model_len: int,
    vocab_size: int,
    reply_to: str,
) -> GenerateRequest:
    """Validate and translate; raises InvalidRequest naming the parameter."""
    if body.stream_options is not None and not body.stream:
        raise InvalidRequest("stream_options is only allowed when stream is true", "stream_options")
    prompt = tokenizer.encode(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
    if not prompt:
        raise InvalidRequest("the prompt is empty", "prompt")
    if max(prompt) >= vocab_size:
        raise InvalidRequest(f"prompt token ids must be in [0, {vocab_size})", "prompt")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    sampling = SamplingParams(
        n=body.n,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        repetition_penalty=body.repetition_penalty,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        seed=body.seed,
        logprobs=body.logprobs,
        stop=stop,
        stop_token_ids=body.stop_token_ids,
        ignore_eos=body.ignore_eos,
        max_tokens=body.max_tokens,
        min_tokens=body.min_tokens,
        skip_special_tokens=body.skip_special_tokens,
    )
    sampling.validate(vocab_size)
    if len(prompt) + body.max_tokens > max_model_len:
        raise InvalidRequest(
            f"this model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{len(prompt)} tokens and max_tokens is {body.max_tokens} "
            f"({len(prompt) + body.max_tokens} in total)",
            "max_tokens",
        )
    prompt_b64 = encode_token_ids(prompt)
    output = OutputOptions(
        kind="completion",
        model=body.model,
        created=int(time.time()),
        stream=body.stream,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        echo_prompt=(body.prompt if isinstance(body.prompt, str) else tokenizer.decode(prompt))
        if body.echo
        else None,
        stop=stop,
        skip_special_tokens=body.skip_special_tokens,
        prompt_token_ids_b64=prompt_b64,
    )
    return GenerateRequest(
        request_id=new_request_id(),
        prompt_token_ids_b64=prompt_b64,
        sampling=sampling,
        output=output,
        reply_to=reply_to,
        cache_salt=body.cache_salt,
        priority=body.priority,
        arrival_time=time.time(),
    )
