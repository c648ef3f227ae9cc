"""What postproc workers receive: each request's start (how to render it, where to send it)
and its tokens, step by step, from the engine workers.

A PostprocStart is made by the orchestrator and packed once; the engine worker that sends the
request's first TokenBatch forwards it there unread, so it arrives before, and on the same
socket as, the request's tokens. (Abort, from the orchestrator, is in to_orchestrator.py.)
"""

from __future__ import annotations

from typing import Literal

import msgspec

from common.parser_choice import ParserState
from common.protocol.wire import _Message
from common.responses_schema import ResponseSettings
from common.stage_times import StageTimes

# Why a choice ended: the engine's own reasons ("stop": a stop token or EOS, "length":
# max_tokens or the context, "abort": aborted), and FAILED, a request that failed (the error
# reaches the frontend from the orchestrator). Decoding rejects any other value.
FinishReason = Literal["stop", "length", "abort", "error"]


class OutputOptions(msgspec.Struct, omit_defaults=True, kw_only=True):
    """How the postproc worker turns this request's tokens into OpenAI (or Anthropic) bytes."""

    kind: Literal["completion", "chat", "anthropic", "responses", "embedding"] = "completion"
    model: str = ""
    created: int = 0
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage on every chunk
    response_id: str = ""  # the id the client sees, when it is not the request id (prompt lists)
    index_offset: int = 0  # added to choice indexes: prompt i of a list starts at i * n
    # One of a prompt list's sub-requests: streamed, it ends with no usage chunk and no [DONE],
    # since the frontend writes the response's one ending from the ending Chunks' numbers
    fanned_out: bool = False
    echo_prompt: str | None = None  # completion echo: the prompt text to prepend
    # stop strings, matched on the text here (engines know only SamplingParams.stop_token_ids)
    stop: list[str] = msgspec.field(default_factory=list)
    skip_special_tokens: bool = True
    echo_only: bool = False  # max_tokens 0 with echo: the one token sampled is not output
    # best_of > n: the engine samples best_of choices (with log-probs, to rank them); the answer
    # holds the `keep_best` with the highest cumulative log-prob, and `output_logprobs` (the
    # client's own `logprobs`, None: none) decides what is shown. 0: every choice, as sampled.
    keep_best: int = 0
    output_logprobs: int | None = None
    responses: ResponseSettings | None = None  # kind "responses": the settings it echoes
    embedding_base64: bool = False  # kind "embedding": base64 of float32 LE, else a float list
    parser_state: ParserState | None = None  # chat-like kinds: the reasoning / tool parsers
    # Prompt tokens not billed in usage: a forced tool call's prefix the frontend appended after
    # the template (the seed's prompt_tokens_excluded_from_usage)
    prompt_tokens_excluded: int = 0
    return_token_ids: bool = False  # prompt and output token ids in the body / chunks (vLLM's)
    perf_metrics: bool = False  # the request's StageTimes in the body / last chunk


# Prompt tokens the postproc worker's detokenizer keeps as left context for a choice's first
# output tokens (SentencePiece drops a word-initial space at the start of a decode).
PROMPT_CONTEXT_TOKENS = 5


class PostprocStart(msgspec.Struct, omit_defaults=True, kw_only=True):
    """What the postproc worker reads of a request: how to render it, where to send it, and
    the few sampling settings that shape the answer. Made by the orchestrator from the
    GenerateRequest (`postproc_start`) and packed once (`pack_postproc_start`): engines forward
    it on the request's first TokenBatch without decoding it, since they read none of it."""

    request_id: str
    reply_to: str  # the frontend's PULL address for this request's chunks
    output: OutputOptions
    n: int = 1  # choices (SamplingParams.n)
    logprobs: int | None = None  # SamplingParams.logprobs: recorded, to show or to rank
    min_tokens: int = 0  # SamplingParams.min_tokens: stop strings are ignored before this many
    num_prompt_tokens: int = 0
    # The whole prompt, only when the answer shows it (return_token_ids, completion echo);
    # otherwise its last PROMPT_CONTEXT_TOKENS or so, the detokenizer's left context
    prompt_token_ids_b64: str = ""
    prompt_tail_b64: str = ""


_start_encoder = msgspec.msgpack.Encoder()
_start_decoder = msgspec.msgpack.Decoder(PostprocStart)


def pack_postproc_start(start: PostprocStart) -> msgspec.Raw:
    return msgspec.Raw(_start_encoder.encode(start))


def unpack_postproc_start(packed: msgspec.Raw) -> PostprocStart:
    """Raises msgspec.DecodeError / ValidationError on a malformed start."""
    return _start_decoder.decode(packed)


# TokenDelta.finish_reason of a request that failed: its postproc worker drops it and sends the
# frontend nothing, since the frontend hears of the failure (the error to answer) from the
# orchestrator.
FAILED: FinishReason = "error"


class TokenDelta(msgspec.Struct, array_like=True, omit_defaults=True):
    """New tokens of one choice of one request, from one engine step."""

    request_id: str
    index: int
    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # SamplingParams.prompt_logprobs, with choice 0's first token: (log-prob, top alternatives)
    # of prompt tokens 1, 2, ... given the ones before
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    embedding: bytes | None = None  # SamplingParams.embed: the pooled vector, float32 LE
    # On a choice's first token, the stages up to it; on its last, every stage
    times: StageTimes | None = None
    # A beam search's prompt, prefilled by a context worker (no token): its best continuations,
    # (token id, log-prob), from which the generation worker starts the beams
    beam_candidates: list[tuple[int, float]] | None = None


class TokenBatch(_Message, tag="tokens"):
    deltas: list[TokenDelta]
    # the packed PostprocStart of each request new to this postproc worker, as it came
    starts: list[msgspec.Raw] = msgspec.field(default_factory=list)
