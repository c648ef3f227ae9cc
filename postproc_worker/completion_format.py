"""POST /v1/completions' bytes: text choices, the echoed prompt, legacy log-probs (the prompt's
tokens first when echoed, as scoring harnesses read them), and best_of's ranked choices."""

from __future__ import annotations

from typing import TYPE_CHECKING

from common.openai_schema import Completion, CompletionChoice, CompletionLogprobs, Usage
from postproc_worker.openai_frames import (
    chunk_usage,
    end_of_stream,
    finite,
    json_encoder,
    sse,
)

if TYPE_CHECKING:
    from postproc_worker.formatter import ChoiceState, RequestState, TokenLogprob


class CompletionRenderer:
    def __init__(self, state: RequestState) -> None:
        self.state = state

    def stream_frames(self, choice: ChoiceState, text: str) -> bytes:
        echoed = False  # this chunk carries the echoed prompt (and, with logprobs, its tokens)
        if not choice.started:
            choice.started = True
            text, echoed = self.state.echo + text, True
        if not text and choice.finish_reason is None:
            return b""  # nothing visible yet: logprobs wait for the chunk that carries the text
        records, choice.logprobs = choice.logprobs, []
        completion_choice = CompletionChoice(
            index=choice.index + self.state.index_offset,
            text=text,
            logprobs=self._logprobs(records, with_prompt=echoed),
            finish_reason=choice.finish_reason,
        )
        if self.state.return_token_ids:  # the prompt's ids with a choice's first chunk
            completion_choice.token_ids = choice.take_token_ids()
            if echoed:
                completion_choice.prompt_token_ids = self.state.prompt_token_ids
        return sse(self._completion([completion_choice]))

    def end_frames(self) -> bytes:
        return end_of_stream(self.state, lambda usage: self._completion([], usage))

    def body(self) -> bytes:
        choices = [
            CompletionChoice(
                index=index + self.state.index_offset,
                text=self.state.echo + "".join(c.text_parts),
                logprobs=self._logprobs(c.logprobs, with_prompt=True),
                finish_reason=c.finish_reason,
            )
            for index, c in enumerate(self.state.answered_choices())
        ]
        if self.state.return_token_ids:
            for completion_choice, c in zip(choices, self.state.answered_choices(), strict=True):
                completion_choice.prompt_token_ids = self.state.prompt_token_ids
                completion_choice.token_ids = c.token_ids
        # every sampled choice counts in the usage, best_of's unshown ones too
        completion = self._completion(choices, self.state.usage())
        if self.state.perf_metrics:
            completion.perf_metrics = self.state.times
        return json_encoder.encode(completion)

    def _completion(
        self, choices: list[CompletionChoice], usage: Usage | None = None
    ) -> Completion:
        state = self.state
        return Completion(
            id=state.response_id,
            created=state.created,
            model=state.model,
            choices=choices,
            usage=usage if usage is not None else chunk_usage(state),
        )

    def _logprobs(
        self, records: list[TokenLogprob], *, with_prompt: bool
    ) -> CompletionLogprobs | None:
        """Legacy format: top_logprobs maps token text to logprob, sampled token always included;
        `with_prompt` (the chunk or body that carries the echo): the prompt's tokens first."""
        state = self.state
        if state.num_logprobs is None:
            return None
        text = state.tokenizer.token_text
        logprobs = CompletionLogprobs()
        if with_prompt and state.echo and state.prompt_logprobs is not None:
            self._add_prompt_logprobs(logprobs)
        for r in records:
            top = {text(t): finite(lp) for t, lp in r.top[: state.num_logprobs]}
            top.setdefault(text(r.token_id), finite(r.logprob))
            logprobs.tokens.append(text(r.token_id))
            logprobs.token_logprobs.append(finite(r.logprob))
            logprobs.top_logprobs.append(top)
            logprobs.text_offset.append(r.text_offset)
        return logprobs

    def _add_prompt_logprobs(self, logprobs: CompletionLogprobs) -> None:
        """The echoed prompt's tokens: the first has no log-prob (nothing came before it)."""
        state = self.state
        assert state.prompt_logprobs is not None
        text = state.tokenizer.token_text
        offset = 0
        for i, token_id in enumerate(state.prompt_token_ids):
            token = text(token_id)
            logprobs.tokens.append(token)
            logprobs.text_offset.append(offset)
            offset += len(token)
            if i == 0 or i > len(state.prompt_logprobs):
                logprobs.token_logprobs.append(None)
                logprobs.top_logprobs.append(None)
                continue
            logprob, top = state.prompt_logprobs[i - 1]
            alternatives = {text(t): finite(lp) for t, lp in top[: state.num_logprobs]}
            alternatives.setdefault(token, finite(logprob))
            logprobs.token_logprobs.append(finite(logprob))
            logprobs.top_logprobs.append(alternatives)
