"""What the OpenAI chat and completion renderers share: SSE framing, the usage object, and
log-probs that JSON can carry."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec
from msgspec import UNSET, UnsetType

from common.openai_schema import ChatCompletionChunk, Completion, PromptTokensDetails, Usage

if TYPE_CHECKING:
    from postproc_worker.formatter import RequestState

SSE_DONE = b"data: [DONE]\n\n"
MIN_LOGPROB = -9999.0  # stands for -inf (JSON has no infinity), as in vLLM

json_encoder = msgspec.json.Encoder()


def sse(payload: Completion | ChatCompletionChunk) -> bytes:
    return b"data: " + json_encoder.encode(payload) + b"\n\n"


def end_of_stream(
    state: RequestState, last_chunk: Callable[[Usage | None], Completion | ChatCompletionChunk]
) -> bytes:
    """A stream's closing frames: a last chunk with no choices when the client asked for the
    usage or the perf metrics (or both), then [DONE]. None for one of a prompt list's streams:
    the frontend writes that response's one ending (frontend/generation.py)."""
    if state.fanned_out:
        return b""
    if not (state.include_usage or state.perf_metrics):
        return SSE_DONE
    last = last_chunk(state.usage() if state.include_usage else None)
    if state.perf_metrics:
        last.perf_metrics = state.times
    return sse(last) + SSE_DONE


def usage(num_prompt_tokens: int, num_cached_tokens: int, num_completion_tokens: int) -> Usage:
    return Usage(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=num_completion_tokens,
        total_tokens=num_prompt_tokens + num_completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached_tokens),
    )


def chunk_usage(state: RequestState) -> Usage | None | UnsetType:
    """A chunk's usage: the counts so far with stream_options.continuous_usage_stats; else
    `"usage": null` when the client asked for the usage chunk, and absent otherwise."""
    if state.continuous_usage:
        return state.usage()
    return None if state.include_usage else UNSET


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB
