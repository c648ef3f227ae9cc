"""Incremental detokenization of one choice: new text per token, never half a UTF-8 character.

Byte-level BPE tokens may hold part of a multi-byte character, so decoding token by token would show
U+FFFD to the client. Decoding the whole output each step is correct but quadratic. Like vLLM, this
decodes only a short window and emits the difference:

    tokens:  ... | prefix_offset ........ | read_offset ........ | (new)
                   already emitted, kept    not yet emitted:
                   as left context          held while its text ends in U+FFFD

    delta = decode(window)[len(decode(tokens[prefix_offset:read_offset])):]

Once the delta ends in a whole character, the offsets move forward and tokens left of the new
prefix_offset are dropped. The left context matters for tokenizers whose decoder depends on it
(SentencePiece drops the space of a word-initial piece at the start of a decode).
"""

from __future__ import annotations

from collections.abc import Sequence

from common.protocol import PROMPT_CONTEXT_TOKENS  # the prompt's tail the orchestrator sends
from common.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Per-choice detokenization state; `add` costs O(new tokens + window), whatever the length."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        skip_special_tokens: bool = True,
        prompt_token_ids: Sequence[int] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_ids = tokenizer.special_ids if skip_special_tokens else frozenset()
        context = [i for i in prompt_token_ids[-PROMPT_CONTEXT_TOKENS:] if i not in self._skip_ids]
        if tokenizer.decode(context, skip_special_tokens=False).endswith(REPLACEMENT_CHAR):
            context = []  # a prompt ending mid-character would swallow the first output character
        self._window: list[int] = context  # tokens from prefix_offset on
        self._read_offset = len(context)  # in the window: where the not-yet-emitted tokens start
        self.num_chars = 0  # characters emitted so far

    def add(self, token_ids: Sequence[int]) -> str:
        """Feed new tokens; return the text they complete (possibly "")."""
        kept = [i for i in token_ids if i not in self._skip_ids]
        if not kept:
            return ""
        self._window.extend(kept)
        prefix_text = self._decode(self._window[: self._read_offset])
        text = self._decode(self._window)
        if len(text) <= len(prefix_text) or text.endswith(REPLACEMENT_CHAR):
            return ""  # an incomplete character (or no visible text yet): wait for more tokens
        del self._window[: self._read_offset]
        self._read_offset = len(self._window)
        return self._emit(text[len(prefix_text) :])

    def flush(self) -> str:
        """At the end of the choice: whatever is held, even an incomplete character (as U+FFFD)."""
        prefix_text = self._decode(self._window[: self._read_offset])
        text = self._decode(self._window)
        del self._window[: self._read_offset]
        self._read_offset = len(self._window)
        return self._emit(text[len(prefix_text) :])

    def _emit(self, delta: str) -> str:
        self.num_chars += len(delta)
        return delta

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=False)
