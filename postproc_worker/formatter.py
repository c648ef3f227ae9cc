"""One request's post-processing: token deltas in, OpenAI bytes out (SSE frames, or one JSON body).

    TokenDelta (one choice) ──▶ detokenizer ──▶ stop strings ──▶ [parsers] ──▶ chunk / body

The reasoning / tool-call parsers (parsers/) run for kinds "chat" and "anthropic", when the
request's `parser_state` asks for them; a choice that called a tool and ended by stop finishes
with "tool_calls" (Anthropic: stop_reason "tool_use").

Kind "anthropic" shares everything up to the parsed output; `anthropic_format` shapes its bytes.

A `RequestState` lives in the postproc worker from the request's first TokenBatch until `done`.
Each `add(delta)` returns the bytes to push to the frontend, whether the request is done, and
whether the engine must be told to stop (a stop string matched while it was still decoding: send
`Abort(reason="stop")`). Abort carries only the request id, so with n > 1 a choice that hit a
stop string keeps decoding upstream (its tokens are dropped here) until every choice is finished.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

from common.openai_schema import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatLogprobs,
    ChatMessage,
    ChatTokenLogprob,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    DeltaMessage,
    PromptTokensDetails,
    TopLogprob,
    Usage,
)
from common.protocol import GenerateRequest, OutputOptions, TokenDelta, decode_token_ids
from common.responses_schema import ResponseSettings
from common.tokenizer import Tokenizer
from postproc_worker import anthropic_format, responses_format
from postproc_worker.detokenizer import IncrementalDetokenizer
from postproc_worker.parsers import ChoiceParsers, ParsedText, ParserState, special_texts
from postproc_worker.stop_strings import StopStringMatcher

SSE_DONE = b"data: [DONE]\n\n"
MIN_LOGPROB = -9999.0  # stands for -inf (JSON has no infinity), as in vLLM

_json = msgspec.json.Encoder()


@dataclass(slots=True)
class StepOutput:
    """What to do after a delta: push `data` (if any), drop the request, abort upstream.

    `ending` is the tail of `data` that closes the response (the usage chunk and [DONE], or the
    whole body): the worker sends it as the request's last Chunk, apart from the text before it,
    so that a frontend merging several prompts' streams can find and merge the endings.
    """

    data: bytes = b""
    done: bool = False
    abort_upstream: bool = False
    ending: bytes = b""


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


# The other APIs' shapes, each in its own module behind one contract: stream_frames(parsed, usage),
# end_frames(finish_reason, stop_sequence, called_tools, usage), body(parsed, ...), usage(...).
Renderer = anthropic_format.AnthropicRenderer | responses_format.ResponsesRenderer


def _renderer(request: GenerateRequest) -> Renderer | None:
    """The renderer of a request's API; None for completions and chat, rendered here."""
    options = request.output
    if options.kind == "anthropic":
        return anthropic_format.AnthropicRenderer(request.request_id, options.model)
    if options.kind == "responses":
        settings = options.responses or ResponseSettings()
        return responses_format.ResponsesRenderer(
            request.request_id, options.model, options.created, settings
        )
    return None


class RequestState:
    """Everything the postproc worker keeps for one request, built from its GenerateRequest."""

    def __init__(self, request: GenerateRequest, tokenizer: Tokenizer) -> None:
        options = request.output
        self.request_id = request.request_id
        self._response_id = options.response_id or request.request_id  # what the client sees
        self._index_offset = options.index_offset
        self._tokenizer = tokenizer
        self._chat = options.kind == "chat"
        self._renderer = _renderer(request)  # None: completions and chat, rendered here
        self._stream = options.stream
        self._include_usage = options.include_usage
        self._model = options.model
        self._created = options.created
        self._echo = "" if self._chat else options.echo_prompt or ""
        self._echo_only = options.echo_only
        self._record_logprobs = request.sampling.logprobs is not None  # to show, or to rank
        # None: not asked for (best_of ranks by log-probs the client may not have asked for)
        self._num_logprobs = (
            options.output_logprobs if options.keep_best else request.sampling.logprobs
        )
        self._keep_best = options.keep_best
        # echo with logprobs: the prompt's tokens come first in each choice's logprobs
        self._prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
        self._min_tokens = request.sampling.min_tokens  # stop strings are ignored before this many
        prompt = request.prompt_token_ids_b64
        prompt_token_ids = decode_token_ids(prompt) if prompt else []
        self.num_prompt_tokens = len(prompt_token_ids)
        self._prompt_token_ids = prompt_token_ids
        self.num_cached_tokens = 0
        self.done = False
        self._parser_error: ValueError | None = None  # raised by `add`: fails this request only
        parser_state = self._parser_state(options)
        self.choices = [
            ChoiceState(
                index=i,
                detokenizer=IncrementalDetokenizer(
                    tokenizer,
                    # Parsers must see their markers, special tokens or not; they drop the rest.
                    skip_special_tokens=options.skip_special_tokens and parser_state is None,
                    prompt_token_ids=prompt_token_ids,
                ),
                stop=StopStringMatcher(options.stop),
                parsers=ChoiceParsers(parser_state, special_texts(tokenizer))
                if parser_state is not None
                else None,
            )
            for i in range(request.sampling.n)
        ]

    def _parser_state(self, options: OutputOptions) -> ParserState | None:
        if options.kind == "completion" or not options.parser_state:
            return None
        try:
            state = ParserState.from_dict(options.parser_state)
        except msgspec.ValidationError as exc:
            self._parser_error = ValueError(f"invalid parser_state: {exc}")
            return None
        return state if state.active else None

    @property
    def num_completion_tokens(self) -> int:
        return sum(c.num_tokens for c in self.choices)

    def add(self, delta: TokenDelta) -> StepOutput:
        """Feed one choice's new tokens; late ones (request done, or choice stopped) are dropped."""
        if self._parser_error is not None:
            raise self._parser_error
        if self.done:
            return StepOutput(done=True)
        choice = self.choices[delta.index]
        self.num_prompt_tokens = max(self.num_prompt_tokens, delta.num_prompt_tokens)
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        if delta.prompt_logprobs is not None and self._prompt_logprobs is None:
            self._prompt_logprobs = delta.prompt_logprobs  # sent once, with the first token
        if delta.finish_reason is not None:
            choice.engine_finished = True
        if choice.finish_reason is not None:
            return StepOutput()
        if self._echo_only:  # max_tokens 0: the prompt is the whole answer
            delta = msgspec.structs.replace(delta, token_ids=[], finish_reason="length")
        text = self._consume(choice, delta)
        if self._stream:
            data = self._stream_frames(choice, text)
        else:
            choice.text_parts.append(text)
            data = b""
        self.done = all(c.finish_reason is not None for c in self.choices)
        if not self.done:
            return StepOutput(data)
        ending = self._final_frames() if self._stream else self._final_body()
        abort = not all(c.engine_finished for c in self.choices)
        return StepOutput(data + ending, done=True, abort_upstream=abort, ending=ending)

    # --- tokens -> text ---------------------------------------------------------------------------

    def _consume(self, choice: ChoiceState, delta: TokenDelta) -> str:
        """Detokenize, record logprobs, apply stop strings; returns the text the client may see."""
        parts: list[str] = []
        last = len(delta.token_ids) - 1
        for k, token_id in enumerate(delta.token_ids):
            choice.num_tokens += 1
            if self._record_logprobs and delta.logprobs is not None:
                top = delta.top_logprobs[k] if delta.top_logprobs is not None else []
                offset = len(self._echo) + choice.detokenizer.num_chars
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

    # --- streaming --------------------------------------------------------------------------------

    def _stream_frames(self, choice: ChoiceState, text: str) -> bytes:
        if self._renderer is not None:
            parsed = self._parsed(choice, text, final=choice.finish_reason is not None)
            return self._renderer.stream_frames(parsed, self._renderer_usage())
        frames = b""
        echoed = False  # this chunk carries the echoed prompt (and, with logprobs, its tokens)
        if not choice.started:
            choice.started = True
            if self._chat:
                role = DeltaMessage(role="assistant", content="")
                frames += self._sse(
                    self._chat_chunk(
                        ChatChunkChoice(index=choice.index + self._index_offset, delta=role)
                    )
                )
            else:
                text, echoed = self._echo + text, True
        if self._chat:
            return frames + self._chat_frame(choice, text)
        if not text and choice.finish_reason is None:
            return frames  # nothing visible yet: logprobs wait for the chunk that carries the text
        records, choice.logprobs = choice.logprobs, []
        completion_choice = CompletionChoice(
            index=choice.index + self._index_offset,
            text=text,
            logprobs=self._completion_logprobs(records, with_prompt=echoed),
            finish_reason=choice.finish_reason,
        )
        return frames + self._sse(self._completion(completion_choice))

    def _chat_frame(self, choice: ChoiceState, text: str) -> bytes:
        delta = self._delta_message(choice, text)
        if delta == DeltaMessage() and choice.finish_reason is None:
            return b""  # nothing visible yet: logprobs wait for the chunk that carries the text
        records, choice.logprobs = choice.logprobs, []
        chat_choice = ChatChunkChoice(
            index=choice.index + self._index_offset,
            delta=delta,
            logprobs=self._chat_logprobs(records) if records else None,
            finish_reason=self._chat_finish_reason(choice),
        )
        return self._sse(self._chat_chunk(chat_choice))

    def _delta_message(self, choice: ChoiceState, text: str) -> DeltaMessage:
        return self._parsed(choice, text, final=choice.finish_reason is not None).delta()

    @staticmethod
    def _parsed(choice: ChoiceState, text: str, *, final: bool) -> ParsedText:
        if choice.parsers is None:
            return ParsedText("", [text] if text else [])
        return choice.parsers.feed(text, final=final)

    @staticmethod
    def _called_tools(choice: ChoiceState) -> bool:
        """The choice ended by stop after calling a tool: the client's turn to run it."""
        parsers = choice.parsers
        return choice.finish_reason == "stop" and parsers is not None and parsers.num_tool_calls > 0

    def _chat_finish_reason(self, choice: ChoiceState) -> str | None:
        return "tool_calls" if self._called_tools(choice) else choice.finish_reason

    def _final_frames(self) -> bytes:
        if self._renderer is not None:
            choice = self.choices[0]
            return self._renderer.end_frames(
                choice.finish_reason,
                choice.stop.matched,
                self._called_tools(choice),
                self._renderer_usage(),
            )
        frames = b""
        if self._include_usage:
            usage = self._usage()
            if self._chat:
                frames += self._sse(self._chat_chunk(None, usage))
            else:
                frames += self._sse(self._completion(None, usage))
        return frames + SSE_DONE

    def _completion(
        self, choice: CompletionChoice | None, usage: Usage | None = None
    ) -> Completion:
        return Completion(
            id=self._response_id,
            created=self._created,
            model=self._model,
            choices=[choice] if choice is not None else [],
            usage=usage if usage is not None else self._chunk_usage(),
        )

    def _chat_chunk(
        self, choice: ChatChunkChoice | None, usage: Usage | None = None
    ) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self._response_id,
            created=self._created,
            model=self._model,
            choices=[choice] if choice is not None else [],
            usage=usage if usage is not None else self._chunk_usage(),
        )

    def _chunk_usage(self) -> None | UnsetType:
        """`"usage": null` on every chunk when the client asked for the usage chunk, else absent."""
        return None if self._include_usage else UNSET

    @staticmethod
    def _sse(payload: Completion | ChatCompletionChunk) -> bytes:
        return b"data: " + _json.encode(payload) + b"\n\n"

    # --- non-streaming ----------------------------------------------------------------------------

    def _final_body(self) -> bytes:
        if self._renderer is not None:
            choice = self.choices[0]
            parsed = self._parsed(choice, "".join(choice.text_parts), final=True)
            return self._renderer.body(
                parsed,
                choice.finish_reason,
                choice.stop.matched,
                self._called_tools(choice),
                self._renderer_usage(),
            )
        if self._chat:
            return _json.encode(
                ChatCompletion(
                    id=self._response_id,
                    created=self._created,
                    model=self._model,
                    choices=[self._chat_choice(c) for c in self.choices],
                    usage=self._usage(),
                )
            )
        return _json.encode(
            Completion(
                id=self._response_id,
                created=self._created,
                model=self._model,
                choices=[
                    CompletionChoice(
                        index=index + self._index_offset,
                        text=self._echo + "".join(c.text_parts),
                        logprobs=self._completion_logprobs(c.logprobs, with_prompt=True),
                        finish_reason=c.finish_reason,
                    )
                    for index, c in enumerate(self._answered_choices())
                ],
                usage=self._usage(),  # every sampled choice counts, the unshown best_of too
            )
        )

    def _answered_choices(self) -> list[ChoiceState]:
        """The choices the answer holds: all, or best_of's `keep_best` highest cumulative
        log-probs, best first."""
        if not self._keep_best:
            return self.choices
        ranked = sorted(self.choices, key=lambda c: -sum(r.logprob for r in c.logprobs))
        return ranked[: self._keep_best]

    def _chat_choice(self, choice: ChoiceState) -> ChatChoice:
        text = "".join(choice.text_parts)
        return ChatChoice(
            index=choice.index + self._index_offset,
            message=ChatMessage(content=text)
            if choice.parsers is None
            else choice.parsers.feed(text, final=True).message(),
            logprobs=self._chat_logprobs(choice.logprobs)
            if self._num_logprobs is not None
            else None,
            finish_reason=self._chat_finish_reason(choice),
        )

    def _usage(self) -> Usage:
        completion_tokens = sum(c.num_tokens for c in self.choices)
        return Usage(
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=self.num_prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=self.num_cached_tokens),
        )

    def _renderer_usage(self) -> Any:
        assert self._renderer is not None
        return self._renderer.usage(
            self.num_prompt_tokens, self.num_cached_tokens, self.choices[0].num_tokens
        )

    # --- logprobs ---------------------------------------------------------------------------------

    def _completion_logprobs(
        self, records: list[TokenLogprob], *, with_prompt: bool = False
    ) -> CompletionLogprobs | None:
        """Legacy format: top_logprobs maps token text to logprob, sampled token always included;
        `with_prompt` (the chunk or body that carries the echo): the prompt's tokens first."""
        if self._num_logprobs is None:
            return None
        text = self._tokenizer.token_text
        logprobs = CompletionLogprobs()
        if with_prompt and self._echo and self._prompt_logprobs is not None:
            self._add_prompt_logprobs(logprobs)
        for r in records:
            top = {text(t): _finite(lp) for t, lp in r.top[: self._num_logprobs]}
            top.setdefault(text(r.token_id), _finite(r.logprob))
            logprobs.tokens.append(text(r.token_id))
            logprobs.token_logprobs.append(_finite(r.logprob))
            logprobs.top_logprobs.append(top)
            logprobs.text_offset.append(r.text_offset)
        return logprobs

    def _add_prompt_logprobs(self, logprobs: CompletionLogprobs) -> None:
        """The echoed prompt's tokens: the first has no log-prob (nothing came before it)."""
        assert self._prompt_logprobs is not None
        text = self._tokenizer.token_text
        offset = 0
        for i, token_id in enumerate(self._prompt_token_ids):
            token = text(token_id)
            logprobs.tokens.append(token)
            logprobs.text_offset.append(offset)
            offset += len(token)
            if i == 0 or i > len(self._prompt_logprobs):
                logprobs.token_logprobs.append(None)
                logprobs.top_logprobs.append(None)
                continue
            logprob, top = self._prompt_logprobs[i - 1]
            alternatives = {text(t): _finite(lp) for t, lp in top[: self._num_logprobs]}
            alternatives.setdefault(token, _finite(logprob))
            logprobs.token_logprobs.append(_finite(logprob))
            logprobs.top_logprobs.append(alternatives)

    def _chat_logprobs(self, records: list[TokenLogprob]) -> ChatLogprobs:
        k = self._num_logprobs or 0
        return ChatLogprobs(
            content=[
                ChatTokenLogprob(
                    token=self._tokenizer.token_text(r.token_id),
                    logprob=_finite(r.logprob),
                    token_bytes=list(self._tokenizer.token_bytes(r.token_id)),
                    top_logprobs=[self._top_logprob(t, lp) for t, lp in r.top[:k]],
                )
                for r in records
            ]
        )

    def _top_logprob(self, token_id: int, logprob: float) -> TopLogprob:
        return TopLogprob(
            token=self._tokenizer.token_text(token_id),
            logprob=_finite(logprob),
            token_bytes=list(self._tokenizer.token_bytes(token_id)),
        )


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB
