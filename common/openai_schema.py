"""OpenAI response shapes (completions and chat completions, streamed and not) as msgspec Structs.

The postproc workers encode them; the frontend adds its request schemas here. Fields that
OpenAI sends as `null` default to None and are always encoded; fields that OpenAI leaves out
unless asked for default to UNSET, which msgspec omits (`usage` on chunks without
`stream_options.include_usage`).
"""

from __future__ import annotations

from typing import Literal

import msgspec
from msgspec import UNSET, UnsetType

from common.stage_times import StageTimes


class PromptTokensDetails(msgspec.Struct, kw_only=True):
    cached_tokens: int = 0


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


# --- /v1/completions ------------------------------------------------------------------------------


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    """Legacy completion logprobs: parallel lists, one entry per token."""

    tokens: list[str] = msgspec.field(default_factory=list)
    token_logprobs: list[float | None] = msgspec.field(default_factory=list)  # echo: first None
    top_logprobs: list[dict[str, float] | None] = msgspec.field(default_factory=list)
    text_offset: list[int] = msgspec.field(default_factory=list)


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    # return_token_ids (vLLM's extension): the prompt's ids (streamed: in a choice's first
    # chunk) and the output's (streamed: each chunk's new ones)
    prompt_token_ids: list[int] | UnsetType = UNSET
    token_ids: list[int] | UnsetType = UNSET


class Completion(msgspec.Struct, kw_only=True):
    """The non-streaming body, and (with the same object name) each streamed chunk."""

    id: str
    object_: Literal["text_completion"] = msgspec.field(default="text_completion", name="object")
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None | UnsetType = UNSET
    # return_perf_metrics: where the time went (streamed: in a last chunk with no choices)
    perf_metrics: StageTimes | UnsetType = UNSET


# --- /v1/chat/completions -------------------------------------------------------------------------


class TopLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    token_bytes: list[int] | None = msgspec.field(default=None, name="bytes")


class ChatTokenLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    token_bytes: list[int] | None = msgspec.field(default=None, name="bytes")
    top_logprobs: list[TopLogprob] = msgspec.field(default_factory=list)


class ChatLogprobs(msgspec.Struct, kw_only=True):
    content: list[ChatTokenLogprob] | None = None
    refusal: list[ChatTokenLogprob] | None = None  # required by the API, always null here


class FunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: str  # JSON text


class ToolCall(msgspec.Struct, kw_only=True):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(msgspec.Struct, kw_only=True):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None  # required by the API (nullable): this server never refuses
    reasoning_content: str | UnsetType = UNSET  # set only when a reasoning parser ran
    tool_calls: list[ToolCall] | UnsetType = UNSET  # set only when the choice called tools


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | UnsetType = UNSET  # return_token_ids: the output's ids


class ChatCompletion(msgspec.Struct, kw_only=True):
    id: str
    object_: Literal["chat.completion"] = msgspec.field(default="chat.completion", name="object")
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | UnsetType = UNSET  # return_token_ids
    perf_metrics: StageTimes | UnsetType = UNSET  # return_perf_metrics


class DeltaFunctionCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str | UnsetType = UNSET  # only in a call's first fragment
    arguments: str | UnsetType = UNSET  # the next piece of the arguments' JSON text


class DeltaToolCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One fragment of a streamed tool call: id, type and name come only with its first."""

    index: int
    id: str | UnsetType = UNSET
    type: Literal["function"] | UnsetType = UNSET
    function: DeltaFunctionCall


class DeltaMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A streamed chat delta: only the fields that changed ("{}" on a bare finish chunk)."""

    role: Literal["assistant"] | UnsetType = UNSET
    content: str | None | UnsetType = UNSET  # null: a turn that opens with a tool call (OpenAI's)
    reasoning_content: str | UnsetType = UNSET
    tool_calls: list[DeltaToolCall] | UnsetType = UNSET


class ChatChunkChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | UnsetType = UNSET  # return_token_ids: this chunk's new ids


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    id: str
    object_: Literal["chat.completion.chunk"] = msgspec.field(
        default="chat.completion.chunk", name="object"
    )
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None | UnsetType = UNSET
    prompt_token_ids: list[int] | UnsetType = UNSET  # return_token_ids: in the first chunk
    perf_metrics: StageTimes | UnsetType = UNSET  # return_perf_metrics: in the last chunk


# --- /v1/embeddings -------------------------------------------------------------------------------


class Embedding(msgspec.Struct, kw_only=True):
    index: int
    embedding: list[float] | str  # floats, or base64 of little-endian float32 (encoding_format)
    object_: Literal["embedding"] = msgspec.field(default="embedding", name="object")


class EmbeddingUsage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(msgspec.Struct, kw_only=True):
    """The body of POST /v1/embeddings; one per input inside the cluster, merged by the
    frontend when the input is a list."""

    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
    object_: Literal["list"] = msgspec.field(default="list", name="object")
