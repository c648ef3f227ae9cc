"""POST /v1/completions: the request body, its prompt forms, and the translation into one
GenerateRequest per prompt (a list of prompts fans out; the frontend merges the answers)."""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec

from common.errors import InvalidRequest
from common.guided import check
from common.protocol import GenerateRequest, OutputOptions, decode_token_ids, encode_token_ids
from common.sampling_params import MAX_N
from frontend import seed_extensions
from frontend.model_info import ModelInfo
from frontend.sampling import (
    COMPLETION_DEFAULT_MAX_TOKENS,
    SamplingFields,
    check_logprobs,
    logit_bias,
    max_tokens_for,
    sampling_params,
    stop_list,
)
from frontend.seed_extensions import (
    ConversationParams,
    LoRARequest,
    SchedulingParams,
    check_disaggregated,
    conversation_id,
)
from frontend.structured import ResponseFormat, from_guided_fields


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    include_usage: bool = False  # a last chunk with the usage and no choices
    continuous_usage_stats: bool = False  # the seed's and vLLM's: the usage so far on every chunk


class CompletionRequest(SamplingFields, forbid_unknown_fields=True, kw_only=True):
    """The body of POST /v1/completions: the sampling fields (SamplingFields) and these."""

    model: str
    prompt: str | list[Any] | None = None  # a string, strings, token ids, or lists of ids
    suffix: str | None = None  # not supported: a 400 when set
    max_tokens: int | None = COMPLETION_DEFAULT_MAX_TOKENS
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: int | None = None
    echo: bool = False
    user: str | None = None
    # extensions, as in vLLM
    return_token_ids: bool = False  # prompt and output token ids in the answer (vLLM's)
    return_perf_metrics: bool = False  # where the time went (StageTimes), in the answer
    cache_salt: str | None = None
    priority: int = 0
    prompt_token_ids_b64: str | None = None  # base64 of little-endian int32 ids, instead of prompt
    # the seed's serving extensions (frontend/seed_extensions.py)
    lora_request: LoRARequest | None = None
    conversation_params: ConversationParams | None = None
    scheduling_params: SchedulingParams | None = None
    disaggregated_params: dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None  # Lark, llguidance's dialect


def new_request_id(prefix: str = "cmpl") -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sub_request_id(request_id: str, index: int, count: int) -> str:
    """The cluster's id for prompt `index` of `count` fanned out from one client request; the
    client sees `request_id` (the frontend merges the answers)."""
    return request_id if count == 1 else f"{request_id}-{index}"


def prompt_list(body: CompletionRequest, model: ModelInfo) -> list[tuple[list[int], str]]:
    """Every prompt as (token ids, text for echo); ids are checked against the vocabulary and
    text against the context's size before anything is decoded or tokenized."""
    tokenizer = model.tokenizer
    if (body.prompt is None) == (body.prompt_token_ids_b64 is None):
        raise InvalidRequest("give exactly one of prompt and prompt_token_ids_b64", "prompt")
    if body.prompt_token_ids_b64 is not None:
        try:
            ids = decode_token_ids(body.prompt_token_ids_b64)
        except ValueError as e:
            raise InvalidRequest(f"prompt_token_ids_b64: {e}", "prompt_token_ids_b64") from None
        check_token_ids(ids, model, "prompt_token_ids_b64")
        return [(ids, tokenizer.decode(ids, skip_special_tokens=False))]
    prompt = body.prompt
    texts: list[str] = []
    if isinstance(prompt, str):
        texts = [prompt]
    elif prompt and all(isinstance(p, str) for p in prompt):
        texts = prompt
    if texts:
        _check_count(len(texts), body.best_of or body.n)
        for text in texts:
            model.check_prompt_chars(len(text), "prompt")
        return [(tokenizer.encode(text), text) for text in texts]
    assert isinstance(prompt, list)
    if prompt and all(is_token_id(t) for t in prompt):
        check_token_ids(prompt, model, "prompt")
        return [(list(prompt), tokenizer.decode(prompt, skip_special_tokens=False))]
    if prompt and all(isinstance(p, list) and p and all(is_token_id(t) for t in p) for p in prompt):
        _check_count(len(prompt), body.best_of or body.n)
        for ids in prompt:
            check_token_ids(ids, model, "prompt")
        return [(list(p), tokenizer.decode(p, skip_special_tokens=False)) for p in prompt]
    raise InvalidRequest(
        "prompt must be a string, a list of strings, a list of token ids, or a list of lists of "
        "token ids (none empty)",
        "prompt",
    )


def is_token_id(value: object) -> bool:
    """A JSON integer (not a boolean): what a token id in a request body must be."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_token_ids(ids: list[int], model: ModelInfo, param: str) -> None:
    if len(ids) > model.max_model_len:
        raise InvalidRequest(
            f"the prompt has {len(ids)} tokens; this model's maximum context length is "
            f"{model.max_model_len}",
            param,
        )
    if ids and not 0 <= min(ids) <= max(ids) < model.vocab_size:
        raise InvalidRequest(f"prompt token ids must be in [0, {model.vocab_size})", param)


def _check_count(num_prompts: int, n: int) -> None:
    """One request may not take more of the cluster than MAX_N choices in all."""
    if num_prompts * n > MAX_N:
        raise InvalidRequest(
            f"{num_prompts} prompts x n={n} is more than {MAX_N} choices in one request", "prompt"
        )


def to_generate_requests(
    body: CompletionRequest, model: ModelInfo, reply_to: str
) -> list[GenerateRequest]:
    """Validate and translate; raises InvalidRequest naming the parameter."""
    vocab_size, max_model_len = model.vocab_size, model.max_model_len
    if body.suffix is not None:
        raise InvalidRequest("suffix is not supported", "suffix")
    if body.stream_options is not None and not body.stream:
        raise InvalidRequest("stream_options is only allowed when stream is true", "stream_options")
    if body.best_of is not None and body.best_of < body.n:
        raise InvalidRequest(f"best_of ({body.best_of}) must be >= n ({body.n})", "best_of")
    ranked = body.best_of is not None and body.best_of > body.n and not body.use_beam_search
    if ranked and body.stream:
        raise InvalidRequest("best_of cannot be streamed: the best are known at the end", "best_of")
    check_logprobs(body.logprobs, "logprobs")
    check_disaggregated(body.disaggregated_params)
    priority = seed_extensions.priority(body.priority, body.scheduling_params)
    conversation = conversation_id(body.conversation_params)
    constraint = from_guided_fields(
        body.response_format, body.guided_json, body.guided_regex, body.guided_grammar
    )
    if constraint is not None:
        check(constraint, model.ll_tokenizer())
    prompts = prompt_list(body, model)
    bias = logit_bias(body.logit_bias, vocab_size)
    stops = stop_list(body.stop)
    created = int(time.time())
    request_id = new_request_id()
    requests = []
    for i, (prompt, text) in enumerate(prompts):
        if not prompt:
            raise InvalidRequest("the prompt is empty", "prompt")
        if max(prompt) >= vocab_size:
            raise InvalidRequest(f"prompt token ids must be in [0, {vocab_size})", "prompt")
        # max_tokens 0 with echo scores the prompt (lm-eval's loglikelihood): one token is
        # sampled, since a request always samples one, and left out of the answer
        echo_only = body.echo and body.max_tokens == 0
        requested = 1 if echo_only else body.max_tokens
        sampling = sampling_params(
            msgspec.structs.replace(body, n=body.best_of) if ranked else body,
            defaults=model.sampling_defaults,
            vocab_size=vocab_size,
            max_tokens=max_tokens_for(requested, len(prompt), max_model_len),
            logprobs=(body.logprobs or 0) if ranked else body.logprobs,  # ranked by log-prob
            prompt_logprobs=body.logprobs if body.echo else None,
            logit_bias=bias,
            guided=constraint,
            speculative=model.speculative,
        )
        prompt_b64 = encode_token_ids(prompt)
        output = OutputOptions(
            kind="completion",
            model=body.model,
            created=created,
            stream=body.stream,
            include_usage=bool(body.stream_options and body.stream_options.include_usage),
            continuous_usage=bool(
                body.stream_options and body.stream_options.continuous_usage_stats
            ),
            echo_prompt=text if body.echo else None,
            echo_only=echo_only,
            keep_best=body.n if ranked else 0,
            output_logprobs=body.logprobs,
            response_id=request_id,
            index_offset=i * body.n,
            fanned_out=len(prompts) > 1,
            stop=stops,
            skip_special_tokens=body.skip_special_tokens,
            return_token_ids=body.return_token_ids,
            perf_metrics=body.return_perf_metrics,
        )
        requests.append(
            GenerateRequest(
                request_id=sub_request_id(request_id, i, len(prompts)),
                prompt_token_ids_b64=prompt_b64,
                sampling=sampling,
                output=output,
                reply_to=reply_to,
                cache_salt=body.cache_salt,
                priority=priority,
                conversation_id=conversation,
            )
        )
    return requests
