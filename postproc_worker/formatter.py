"""One request's post-processing: token deltas in, the API's bytes out (SSE frames, or one body).

    TokenDelta (one choice) ──▶ detokenizer ──▶ stop strings ──▶ [parsers] ──▶ renderer ──▶ bytes

This module is the pipeline every API shares; each API's shapes live in its own module behind
one contract (`Renderer`): completion_format, chat_format, anthropic_format, responses_format,
embedding_format. The reasoning / tool-call parsers (parsers/) run for the chat-like kinds when
the request's `parser_state` asks for them; a choice that called a tool and ended by stop
finishes with "tool_calls" (Anthropic: stop_reason "tool_use").

A `RequestState` lives in the postproc worker from the request's first TokenBatch until `done`.
Each `add(delta)` returns the bytes to push to the frontend, whether the request is done, and
whether the engine must be told to stop (a stop string matched while it was still decoding: send
`Abort(reason="stop")`). Abort carries only the request id, so with n > 1 a choice that hit a
stop string keeps decoding upstream (its tokens are dropped here) until every choice is finished.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from common.openai_schema import Usage
from common.parser_choice import ParserState
from common.protocol import OutputOptions, PostprocStart, TokenDelta, decode_token_ids
from common.responses_schema import ResponseSettings
from common.stage_times import StageTimes
from common.tokenizer import Tokenizer
from postproc_worker import (
    anthropic_format,
    chat_format,
    completion_format,
    embedding_format,
    openai_frames,
    responses_format,
)
from postproc_worker.detokenizer import IncrementalDetokenizer
from postproc_worker.parsers import ChoiceParsers, ParsedText, special_texts
from postproc_worker.stop_strings import StopStringMatcher


@dataclass(slots=True)
class StepOutput:
    """What to do after a delta: push `data` (if any), drop the request, abort upstream."""

    data: bytes = b""
    done: bool = False
    abort_upstream: bool = False


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    text_offset: int  # characters before this token in the choice's text (echo included)


@dataclass(slots=True)
class ChoiceState:
    index: int
    detokenizer: IncrementalDetokenizer
    stop: StopStringMatcher
    parsers: ChoiceParsers | None  # chat with parser_state: reasoning / tool-call parsing
    text_parts: list[str] = field(default_factory=list)  # non-streaming: the whole text so far
    logprobs: list[TokenLogprob] = field(default_factory=list)  # streaming: only those not yet sent
    num_tokens: int = 0
    finish_reason: str | None = None  # set once the client's view of the choice is complete
    engine_finished: bool = False  # the engine sent this choice's finish_reason
    started: bool = False  # streaming: the first chunk (role, or echo) went out
    # return_token_ids: the output's ids (streaming: only those not yet sent)
    token_ids: list[int] = field(default_factory=list)

    def take_token_ids(self) -> list[int]:
        """Streaming: the ids not sent yet, handed to the chunk that sends them."""
        ids, self.token_ids = self.token_ids, []
        return ids


class Renderer(Protocol):
    """One API's bytes from the pipeline's state (the renderer keeps the RequestState)."""

    def stream_frames(self, choice: ChoiceState, text: str) -> bytes:
        """SSE frames for `text`, the newly visible text of `choice` (maybe its last)."""
        ...

    def end_frames(self) -> bytes:
        """The frames that close a stream, once every choice is finished."""
        ...

    def body(self) -> bytes:
        """The whole non-streamed body, once every choice is finished."""
        ...


class SingleChoiceRenderer:
    """The APIs with one choice and their own usage object (Anthropic Messages, Responses) render
    from choice 0's parsed output: this adapts their renderers to the contract."""

    def __init__(
        self,
        state: RequestState,
        inner: anthropic_format.AnthropicRenderer | responses_format.ResponsesRenderer,
    ) -> None:
        self.state = state
        self.inner = inner

    def stream_frames(self, choice: ChoiceState, text: str) -> bytes:
        parsed = self.state.parsed(choice, text, final=choice.finish_reason is not None)
        return self.inner.stream_frames(parsed, self._usage())

    def end_frames(self) -> bytes:
        choice = self.state.choices[0]
        return self.inner.end_frames(
            choice.finish_reason,
            choice.stop.matched,
            self.state.called_tools(choice),
            self._usage(),
        )

    def body(self) -> bytes:
        choice = self.state.choices[0]
        parsed = self.state.parsed(choice, "".join(choice.text_parts), final=True)
        return self.inner.body(
            parsed,
            choice.finish_reason,
            choice.stop.matched,
            self.state.called_tools(choice),
            self._usage(),
        )

    def _usage(self) -> Any:
        state = self.state
        return self.inner.usage(
            state.billed_prompt_tokens, state.billed_cached_tokens, state.choices[0].num_tokens
        )


def _renderer(state: RequestState, start: PostprocStart) -> Renderer:
    options = start.output
    if options.kind == "chat":
        return chat_format.ChatRenderer(state)
    if options.kind == "embedding":
        return embedding_format.EmbeddingRenderer(state)
    if options.kind == "anthropic":
        anthropic = anthropic_format.AnthropicRenderer(start.request_id, options.model)
        return SingleChoiceRenderer(state, anthropic)
    if options.kind == "responses":
        settings = options.responses or ResponseSettings()
        responses = responses_format.ResponsesRenderer(
            start.request_id, options.model, options.created, settings
        )
        return SingleChoiceRenderer(state, responses)
    return completion_format.CompletionRenderer(state)


class RequestState:
    """Everything the postproc worker keeps for one request, built from its PostprocStart.
    The renderers read its public attributes."""

    def __init__(self, start: PostprocStart, tokenizer: Tokenizer) -> None:
        options = start.output
        self.request_id = start.request_id
        self.response_id = options.response_id or start.request_id  # what the client sees
        self.index_offset = options.index_offset
        self.tokenizer = tokenizer
        self.stream = options.stream
        self.include_usage = options.include_usage
        self.continuous_usage = options.continuous_usage
        self.fanned_out = options.fanned_out  # streamed: the frontend writes the ending
        self.model = options.model
        self.created = options.created
        self.echo = (options.echo_prompt or "") if options.kind == "completion" else ""
        # max_tokens 0 with echo, or an embedding: the one token sampled is not output
        self._no_output = options.echo_only or options.kind == "embedding"
        self._record_logprobs = start.logprobs is not None  # to show, or to rank
        # None: not asked for (best_of ranks by log-probs the client may not have asked for)
        self.num_logprobs = options.output_logprobs if options.keep_best else start.logprobs
        self._keep_best = options.keep_best
        # echo with logprobs: the prompt's tokens come first in each choice's logprobs
        self.prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
        self.embedding: bytes | None = None  # kind "embedding": the pooled vector
        self.embedding_base64 = options.embedding_base64
        self._min_tokens = start.min_tokens  # stop strings are ignored before this many
        # the whole prompt when the answer shows it, else none: only its tail, for detokenizing
        prompt = start.prompt_token_ids_b64
        prompt_token_ids = decode_token_ids(prompt) if prompt else []
        context = prompt_token_ids or decode_token_ids(start.prompt_tail_b64)
        self.num_prompt_tokens = start.num_prompt_tokens
        self.num_unbilled_prompt_tokens = options.prompt_tokens_excluded
        self.return_token_ids = options.return_token_ids
        self.perf_metrics = options.perf_metrics  # the renderers show `times` when asked
        # the stages the workers measured: from the first tokens, then each choice's last
        self.times = StageTimes()
        self.prompt_token_ids = prompt_token_ids
        self.num_cached_tokens = 0
        self.done = False
        parser_state = self._parser_state(options)
        self.choices = [
            ChoiceState(
                index=i,
                detokenizer=IncrementalDetokenizer(
                    tokenizer,
                    # Parsers must see their markers, special tokens or not; they drop the rest.
                    skip_special_tokens=options.skip_special_tokens and parser_state is None,
                    prompt_token_ids=context,
                ),
                stop=StopStringMatcher(options.stop),
                parsers=ChoiceParsers(parser_state, special_texts(tokenizer))
                if parser_state is not None
                else None,
            )
            for i in range(start.n)
        ]
        self._renderer = _renderer(self, start)

    @staticmethod
    def _parser_state(options: OutputOptions) -> ParserState | None:
        state = options.parser_state
        if options.kind in ("completion", "embedding") or state is None or not state.active:
            return None
        return state

    @property
    def num_completion_tokens(self) -> int:
        return sum(c.num_tokens for c in self.choices)

    def add(self, delta: TokenDelta) -> StepOutput:
        """Feed one choice's new tokens; late ones (request done, or choice stopped) are dropped."""
        if self.done:
            return StepOutput(done=True)
        choice = self.choices[delta.index]
        self.num_prompt_tokens = max(self.num_prompt_tokens, delta.num_prompt_tokens)
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        if delta.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = delta.prompt_logprobs  # sent once, with the first token
        if delta.embedding is not None:
            self.embedding = delta.embedding
        if delta.times is not None:
            self.times = delta.times
        if delta.finish_reason is not None:
            choice.engine_finished = True
        if choice.finish_reason is not None:
            return StepOutput()
        if self._no_output:  # the prompt (echoed, or embedded) is the whole answer
            delta = msgspec.structs.replace(delta, token_ids=[], finish_reason="length")
        text = self._consume(choice, delta)
        if self.stream:
            data = self._renderer.stream_frames(choice, text)
        else:
            choice.text_parts.append(text)
            data = b""
        self.done = all(c.finish_reason is not None for c in self.choices)
        if not self.done:
            return StepOutput(data)
        ending = self._renderer.end_frames() if self.stream else self._renderer.body()
        abort = not all(c.engine_finished for c in self.choices)
        return StepOutput(data + ending, done=True, abort_upstream=abort)

    # --- tokens -> text ---------------------------------------------------------------------------

    def _consume(self, choice: ChoiceState, delta: TokenDelta) -> str:
        """Detokenize, record logprobs, apply stop strings; returns the text the client may see."""
        parts: list[str] = []
        last = len(delta.token_ids) - 1
        for k, token_id in enumerate(delta.token_ids):
            choice.num_tokens += 1
            if self.return_token_ids:
                choice.token_ids.append(token_id)
            if self._record_logprobs and delta.logprobs is not None:
                top = delta.top_logprobs[k] if delta.top_logprobs is not None else []
                offset = len(self.echo) + choice.detokenizer.num_chars
                choice.logprobs.append(TokenLogprob(token_id, delta.logprobs[k], top, offset))
            if k == last and delta.finish_reason == "stop":
                break  # the EOS / stop_token_ids token ends the choice; its text is not output
            parts.append(self._apply_stop(choice, choice.detokenizer.add((token_id,))))
            if choice.stop.matched is not None:
                choice.finish_reason = "stop"
                return "".join(parts)
        if delta.finish_reason is not None:
            parts.append(self._apply_stop(choice, choice.detokenizer.flush()))
            if choice.stop.matched is None:
                parts.append(choice.stop.flush())
            choice.finish_reason = (
                "stop" if choice.stop.matched is not None else delta.finish_reason
            )
        return "".join(parts)

    def _apply_stop(self, choice: ChoiceState, text: str) -> str:
        if choice.num_tokens < self._min_tokens:
            return text
        return choice.stop.feed(text)

    # --- what the renderers read ------------------------------------------------------------------

    @staticmethod
    def parsed(choice: ChoiceState, text: str, *, final: bool) -> ParsedText:
        if choice.parsers is None:
            return ParsedText("", [text] if text else [])
        return choice.parsers.feed(text, final=final)

    @staticmethod
    def called_tools(choice: ChoiceState) -> bool:
        """The choice ended by stop after calling a tool: the client's turn to run it."""
        parsers = choice.parsers
        return choice.finish_reason == "stop" and parsers is not None and parsers.num_tool_calls > 0

    def answered_choices(self) -> list[ChoiceState]:
        """The choices the answer holds: all, or best_of's `keep_best` highest cumulative
        log-probs, best first."""
        if not self._keep_best:
            return self.choices
        ranked = sorted(self.choices, key=lambda c: -sum(r.logprob for r in c.logprobs))
        return ranked[: self._keep_best]

    def usage(self) -> Usage:
        """OpenAI's usage: every sampled choice counts."""
        return openai_frames.usage(
            self.billed_prompt_tokens, self.billed_cached_tokens, self.num_completion_tokens
        )

    @property
    def billed_prompt_tokens(self) -> int:
        """The prompt as usage counts it: without a forced tool call's injected prefix."""
        return self.num_prompt_tokens - self.num_unbilled_prompt_tokens

    @property
    def billed_cached_tokens(self) -> int:
        return min(self.num_cached_tokens, self.billed_prompt_tokens)
