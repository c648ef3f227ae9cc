"""Sampling parameters of one request, as they travel from the frontend to the engine workers.
Stop strings and skip_special_tokens are not here: they shape the text, and only the postproc
worker makes text (OutputOptions, common/protocol/to_postproc.py).

A msgspec Struct so it can ride inside protocol messages unchanged; `validate()` is the one place
that decides what the engine accepts, so the HTTP layer and the in-process API reject the same
things.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from common.errors import InvalidRequest

MAX_LOGPROBS = 20  # same ceiling as OpenAI's top_logprobs
MAX_N = 128  # choices per request: more would let one request flood a worker's batch
MAX_BEAM_WIDTH = 16  # every beam is a sequence in the batch, each step
MAX_LENGTH_PENALTY = 10.0  # length ** penalty stays a finite, non-zero float at any length


class GuidedDecoding(msgspec.Struct, frozen=True, kw_only=True):
    """A request's constraint as it travels to both workers: an llguidance grammar (its JSON
    text), built and checked by the frontend (common/guided.py)."""

    grammar: str
    source: str = ""  # what asked for it, for errors and logs: "json_schema", "tool_choice", ...


class ThinkingBudget(msgspec.Struct, frozen=True, kw_only=True):
    """At most `tokens` tokens of thinking (between the model's start and end markers, all
    blocks together); once they are spent inside a block, the engine forces the end marker and
    the answer follows. Built by the frontend, which knows the model's markers and whether the
    prompt leaves the model inside thinking already (a prefilled start marker)."""

    tokens: int
    start: list[int]  # the start marker's token ids
    end: list[int]  # the end marker's token ids: what is forced
    open_at_start: bool = False


class BeamSearch(msgspec.Struct, frozen=True, kw_only=True):
    """Deterministic beam search, as transformers' `generate(num_beams=width)`: `width` beams
    kept, ranked by cumulative log-prob; a finished hypothesis scores
    sum_logprobs / generated_len ** length_penalty. `early_stopping`: True stops once `width`
    hypotheses are done; False stops when the best live beam, at its current length, cannot beat
    the worst done one; "never" (with length_penalty > 0) judges that at max_tokens instead.
    The request's n best hypotheses are its choices."""

    width: int
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    n: int = 1
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # over prompt + output tokens (HF/vLLM semantics)
    presence_penalty: float = 0.0  # over output tokens (OpenAI semantics)
    frequency_penalty: float = 0.0
    seed: int | None = None
    logprobs: int | None = None  # None: no logprobs; k >= 0: sampled token plus k top alternatives
    # The prompt's own log-probs (each prompt token given the ones before it; the first has
    # none), with k top alternatives: what scoring harnesses (lm-eval) read through echo.
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    max_tokens: int = 16
    min_tokens: int = 0
    guided: GuidedDecoding | None = None  # a grammar every sampled token must follow
    # An embedding request: the prompt's last final hidden state, L2-normalized, is the answer
    # (last-token pooling, as for decoder-only embedding models); the request ends with its
    # prompt, and the one token sampled with it is not output.
    embed: bool = False
    thinking_budget: ThinkingBudget | None = None
    beam: BeamSearch | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the field when a value is outside what the engine can honour."""
        _check(1 <= self.n <= MAX_N, "n", f"must be in [1, {MAX_N}], got {self.n}")
        _check(self.temperature >= 0.0, "temperature", f"must be >= 0, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= -1, "top_k", f"must be -1, 0 (disabled) or positive, got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(self.repetition_penalty > 0.0, "repetition_penalty", "must be > 0")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]")
        _check(self.max_tokens >= 1, "max_tokens", f"must be >= 1, got {self.max_tokens}")
        _check(self.min_tokens >= 0, "min_tokens", f"must be >= 0, got {self.min_tokens}")
        _check(
            self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
        )
        if self.logprobs is not None:
            _check(
                0 <= self.logprobs <= MAX_LOGPROBS,
                "logprobs",
                f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}",
            )
        if self.prompt_logprobs is not None:
            _check(
                0 <= self.prompt_logprobs <= MAX_LOGPROBS,
                "prompt_logprobs",
                f"must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}",
            )
        if vocab_size is not None:
            for token_id in list(self.logit_bias or ()) + self.stop_token_ids:
                _check(
                    0 <= token_id < vocab_size,
                    "logit_bias" if token_id in (self.logit_bias or {}) else "stop_token_ids",
                    f"token id {token_id} is outside the vocabulary [0, {vocab_size})",
                )
        if self.thinking_budget is not None:
            budget = self.thinking_budget
            _check(budget.tokens >= 0, "thinking_token_budget", "must be >= 0")
            _check(bool(budget.start and budget.end), "thinking_token_budget",
                   "needs the model's thinking markers")  # fmt: skip
            _check(self.guided is None, "thinking_token_budget",
                   "cannot be combined with a grammar (response_format, guided_*, a forced "
                   "tool call): the forced end of thinking would break it")  # fmt: skip
        if self.beam is not None:
            self._validate_beam(self.beam)
        for value in (self.logit_bias or {}).values():
            _check(-100.0 <= value <= 100.0, "logit_bias", f"bias {value} is outside [-100, 100]")

    def _validate_beam(self, beam: BeamSearch) -> None:
        """Beam search ranks the model's own log-probs: the fields that reshape or sample the
        distribution, or constrain it token by token, have no meaning there and are refused."""
        _check(1 <= beam.width <= MAX_BEAM_WIDTH, "best_of",
               f"(the beam width) must be in [1, {MAX_BEAM_WIDTH}], got {beam.width}")  # fmt: skip
        _check(-MAX_LENGTH_PENALTY <= beam.length_penalty <= MAX_LENGTH_PENALTY, "length_penalty",
               f"must be in [-{MAX_LENGTH_PENALTY}, {MAX_LENGTH_PENALTY}]")  # fmt: skip
        _check(self.n <= beam.width, "n",
               f"({self.n}) must not exceed the beam width ({beam.width})")  # fmt: skip
        refused = {
            "top_p": self.top_p != 1.0,
            "top_k": self.top_k > 0,
            "min_p": self.min_p != 0.0,
            "repetition_penalty": self.repetition_penalty != 1.0,
            "presence_penalty": self.presence_penalty != 0.0,
            "frequency_penalty": self.frequency_penalty != 0.0,
            "seed": self.seed is not None,
            "logprobs": self.logprobs is not None,
            "prompt_logprobs": self.prompt_logprobs is not None,
            "logit_bias": bool(self.logit_bias),
            "response_format": self.guided is not None,
            "thinking_token_budget": self.thinking_budget is not None,
            "embed": self.embed,
        }
        for param, set_ in refused.items():
            _check(not set_, param, "cannot be combined with use_beam_search")


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidRequest(f"{param} {message}", param=param)
