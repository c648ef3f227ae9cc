"""POST /v1/embeddings: the request body and its translation into one GenerateRequest per input.

The served model's own final hidden state of each input's last token, L2-normalized, is the
embedding (last-token pooling, as vLLM pools a decoder-only model served for embeddings). An
input is prefilled like any prompt by whichever engine the orchestrator picks, and ends there:
the engine pools instead of decoding (SamplingParams.embed), the postproc worker renders the
body, and the frontend merges the bodies of a list of inputs (frontend/generation.py).
"""

from __future__ import annotations

import time
from typing import Any, Literal

import msgspec

from common.errors import InvalidRequest
from common.protocol import GenerateRequest, OutputOptions, encode_token_ids
from common.sampling_params import SamplingParams
from frontend.completions import is_token_id, new_request_id, sub_request_id
from frontend.model_info import ModelInfo

MAX_INPUTS = 2048  # the official API's limit on inputs per request


class EmbeddingRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str
    input: str | list[Any]  # a string, strings, token ids, or lists of token ids
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # only the model's own size: no Matryoshka truncation here
    user: str | None = None  # accepted and ignored (README)
    # extensions, as in the completions schema
    cache_salt: str | None = None
    priority: int = 0


def input_list(body: EmbeddingRequest, model: ModelInfo) -> list[list[int]]:
    """Every input as token ids, each non-empty and within the context."""
    raw = body.input
    if isinstance(raw, str):
        inputs: list[Any] = [raw]
    elif raw and all(is_token_id(t) for t in raw):
        inputs = [raw]
    else:
        inputs = raw
    if not inputs:
        raise InvalidRequest("input must not be empty", "input")
    if len(inputs) > MAX_INPUTS:
        raise InvalidRequest(
            f"input holds {len(inputs)} items; at most {MAX_INPUTS} are allowed", "input"
        )
    texts = all(isinstance(item, str) for item in inputs)
    if not texts and not all(_is_token_list(item) for item in inputs):
        raise InvalidRequest(
            "input must be a string, a list of strings, a list of token ids, or a list of "
            "lists of token ids",
            "input",
        )
    if texts:
        for text in inputs:
            model.check_prompt_chars(len(text), "input")
        inputs = [model.tokenizer.encode(text) for text in inputs]
    for ids in inputs:
        _check_ids(ids, model)
    return [list(ids) for ids in inputs]


def _is_token_list(value: object) -> bool:
    return isinstance(value, list) and all(is_token_id(t) for t in value)


def _check_ids(ids: list[int], model: ModelInfo) -> None:
    if not ids:
        raise InvalidRequest("an input has no tokens", "input")
    # the engine samples one token beside the pooled prompt: one position stays free
    if len(ids) >= model.max_model_len:
        raise InvalidRequest(
            f"an input has {len(ids)} tokens; this model embeds at most {model.max_model_len - 1}",
            "input",
        )
    if not 0 <= min(ids) <= max(ids) < model.vocab_size:
        raise InvalidRequest(f"input token ids must be in [0, {model.vocab_size})", "input")


def to_generate_requests(
    body: EmbeddingRequest, model: ModelInfo, reply_to: str
) -> list[GenerateRequest]:
    """Validate and translate; raises InvalidRequest naming the parameter."""
    if body.dimensions is not None and body.dimensions != model.hidden_size:
        raise InvalidRequest(
            f"dimensions must be this model's embedding size ({model.hidden_size}) or left out: "
            "its vectors cannot be shortened without losing what they mean",
            "dimensions",
        )
    inputs = input_list(body, model)
    request_id = new_request_id("embd")
    created = int(time.time())
    requests = []
    for i, ids in enumerate(inputs):
        prompt_b64 = encode_token_ids(ids)
        output = OutputOptions(
            kind="embedding",
            model=body.model,
            created=created,
            response_id=request_id,
            index_offset=i,
            embedding_base64=body.encoding_format == "base64",
        )
        requests.append(
            GenerateRequest(
                request_id=sub_request_id(request_id, i, len(inputs)),
                prompt_token_ids_b64=prompt_b64,
                sampling=SamplingParams(temperature=0.0, max_tokens=1, embed=True),
                output=output,
                reply_to=reply_to,
                cache_salt=body.cache_salt,
                priority=body.priority,
            )
        )
    return requests
