"""POST /v1/chat/completions' bytes: a role chunk first, then content / reasoning / tool-call
deltas from the parsers, per-token log-probs with their bytes, and "tool_calls" as the finish
reason of a choice that called a tool."""

from __future__ import annotations

from typing import TYPE_CHECKING

from msgspec import UNSET

from common.openai_schema import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatLogprobs,
    ChatMessage,
    ChatTokenLogprob,
    DeltaMessage,
    TopLogprob,
    Usage,
)
from postproc_worker.openai_frames import (
    chunk_usage,
    end_of_stream,
    finite,
    json_encoder,
    sse,
)

if TYPE_CHECKING:
    from postproc_worker.formatter import ChoiceState, RequestState, TokenLogprob


ROLE = DeltaMessage(role="assistant", content="")  # a text turn's first chunk


class ChatRenderer:
    def __init__(self, state: RequestState) -> None:
        self.state = state

    def stream_frames(self, choice: ChoiceState, text: str) -> bytes:
        frames = b""
        index = choice.index + self.state.index_offset
        final = choice.finish_reason is not None
        delta = self.state.parsed(choice, text, final=final).delta()
        if delta == DeltaMessage() and not final:
            return frames  # nothing visible yet: logprobs (and ids) wait for the chunk with text
        first = not choice.started
        choice.started = True
        if first and not self._opens_with_calls(delta):
            frames += self._first(self._chunk([ChatChunkChoice(index=index, delta=ROLE)]))
            first = False
        records, choice.logprobs = choice.logprobs, []
        chat_choice = ChatChunkChoice(
            index=index,
            delta=delta,
            logprobs=self._logprobs(records) if records else None,
            finish_reason=self._finish_reason(choice),
        )
        if self.state.return_token_ids:
            chat_choice.token_ids = choice.take_token_ids()
        chunk = self._chunk([chat_choice])
        return frames + (self._first(chunk) if first else sse(chunk))

    @staticmethod
    def _opens_with_calls(delta: DeltaMessage) -> bool:
        """A turn whose first visible delta is a tool call (no content) says so in its first
        chunk, as OpenAI streams it: the role, `content: null` and the call together. Any other
        turn gets the role in a chunk of its own first, `content: ""`."""
        if delta.tool_calls is UNSET or delta.content is not UNSET:
            return False
        delta.role, delta.content = "assistant", None
        return True

    def _first(self, chunk: ChatCompletionChunk) -> bytes:
        """A choice's first chunk: with return_token_ids, the prompt's ids."""
        if self.state.return_token_ids:
            chunk.prompt_token_ids = self.state.prompt_token_ids
        return sse(chunk)

    def end_frames(self) -> bytes:
        return end_of_stream(self.state, lambda usage: self._chunk([], usage))

    def body(self) -> bytes:
        state = self.state
        completion = ChatCompletion(
            id=state.response_id,
            created=state.created,
            model=state.model,
            choices=[self._choice(c) for c in state.choices],
            usage=state.usage(),
        )
        if state.return_token_ids:
            completion.prompt_token_ids = state.prompt_token_ids
        if state.perf_metrics:
            completion.perf_metrics = state.times
        return json_encoder.encode(completion)

    def _choice(self, choice: ChoiceState) -> ChatChoice:
        text = "".join(choice.text_parts)
        chat_choice = ChatChoice(
            index=choice.index + self.state.index_offset,
            message=ChatMessage(content=text)
            if choice.parsers is None
            else choice.parsers.feed(text, final=True).message(),
            logprobs=self._logprobs(choice.logprobs)
            if self.state.num_logprobs is not None
            else None,
            finish_reason=self._finish_reason(choice),
        )
        if self.state.return_token_ids:
            chat_choice.token_ids = choice.token_ids
        return chat_choice

    def _chunk(
        self, choices: list[ChatChunkChoice], usage: Usage | None = None
    ) -> ChatCompletionChunk:
        state = self.state
        return ChatCompletionChunk(
            id=state.response_id,
            created=state.created,
            model=state.model,
            choices=choices,
            usage=usage if usage is not None else chunk_usage(state),
        )

    def _finish_reason(self, choice: ChoiceState) -> str | None:
        return "tool_calls" if self.state.called_tools(choice) else choice.finish_reason

    def _logprobs(self, records: list[TokenLogprob]) -> ChatLogprobs:
        k = self.state.num_logprobs or 0
        return ChatLogprobs(
            content=[
                ChatTokenLogprob(
                    token=self._text(r.token_id),
                    logprob=finite(r.logprob),
                    token_bytes=self._bytes(r.token_id),
                    top_logprobs=[
                        TopLogprob(
                            token=self._text(t), logprob=finite(lp), token_bytes=self._bytes(t)
                        )
                        for t, lp in r.top[:k]
                    ],
                )
                for r in records
            ]
        )

    def _text(self, token_id: int) -> str:
        return self.state.tokenizer.token_text(token_id)

    def _bytes(self, token_id: int) -> list[int]:
        return list(self.state.tokenizer.token_bytes(token_id))
