"""From an OpenAI-style request body to SamplingParams: the defaults pinned in one place, and the
checks every generation route shares (context length, vocabulary).

A sampling field the request leaves out (or sends as null) takes the model's default from its
generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty; an explicit
`do_sample: false` means greedy), as vLLM does, and otherwise OpenAI's: temperature 1.0, top_p
1.0. `frontend.sampling_defaults: openai` ignores the
model's. n is 1, max_tokens 16 for completions, and for chat "up to the context" (OpenAI's
max_completion_tokens).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from common.errors import InvalidRequest
from common.sampling_params import (
    MAX_LOGPROBS,
    BeamSearch,
    GuidedDecoding,
    SamplingParams,
    ThinkingBudget,
)

COMPLETION_DEFAULT_MAX_TOKENS = 16
# The official API's ranges, checked when the body is decoded.
Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """What an omitted sampling field means: OpenAI's values, or the model's where it has one."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    @classmethod
    def of_model(cls, model_dir: Path) -> SamplingDefaults:
        """The fields generation_config.json sets, as vLLM reads them; an explicit
        `do_sample: false` makes greedy the default, as it does for transformers' generate."""
        path = model_dir / "generation_config.json"
        config = json.loads(path.read_text()) if path.is_file() else {}
        known = {f.name: f.type for f in fields(cls)}
        values = {k: v for k, v in config.items() if k in known and v is not None}
        if config.get("do_sample") is False:
            values["temperature"] = 0.0
        return cls(**values)


def stop_list(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not s for s in stops):
        raise InvalidRequest("stop strings must not be empty", "stop")
    return stops


def logit_bias(bias: Mapping[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    """OpenAI sends token ids as JSON object keys (strings)."""
    if bias is None:
        return None
    parsed: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token_id = int(key)
        except ValueError:
            raise InvalidRequest(
                f"logit_bias key {key!r} is not a token id", "logit_bias"
            ) from None
        if not 0 <= token_id < vocab_size:
            raise InvalidRequest(
                f"logit_bias token id {token_id} is outside the vocabulary [0, {vocab_size})",
                "logit_bias",
            )
        parsed[token_id] = value
    return parsed


def check_logprobs(num: int | None, param: str) -> None:
    if num is not None and not 0 <= num <= MAX_LOGPROBS:
        raise InvalidRequest(f"{param} must be in [0, {MAX_LOGPROBS}], got {num}", param)


def max_tokens_for(requested: int | None, num_prompt_tokens: int, max_model_len: int) -> int:
    """The request's max_tokens, or what is left of the context; over the context is a 400 with
    the numbers in the message."""
    if num_prompt_tokens >= max_model_len:
        raise InvalidRequest(
            f"this model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{num_prompt_tokens} tokens",
            "messages" if requested is None else "prompt",
        )
    if requested is None:
        return max_model_len - num_prompt_tokens
    if requested < 1:
        raise InvalidRequest(f"max_tokens must be >= 1, got {requested}", "max_tokens")
    if num_prompt_tokens + requested > max_model_len:
        raise InvalidRequest(
            f"this model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{num_prompt_tokens} tokens and max_tokens is {requested} "
            f"({num_prompt_tokens + requested} in total)",
            "max_tokens",
        )
    return requested


class SamplingFields(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The sampling fields OpenAI's completion and chat bodies (and our extensions) share,
    declared once: both request schemas extend it. temperature, top_p, top_k, min_p and
    repetition_penalty left out (or null) take the model's default (SamplingDefaults)."""

    temperature: Temperature | None = None
    top_p: TopP | None = None
    n: int = 1
    # completions: sampled choices to rank, or with use_beam_search the beam width; chat: only
    # the beam width (use_beam_search required)
    best_of: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: dict[str, float] | None = None
    # extensions, as in vLLM
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    use_beam_search: bool = False  # best_of (else n) beams, the n best returned
    length_penalty: float | None = None  # beam search only (default 1.0)
    early_stopping: bool | Literal["never"] | None = None  # beam search only (default false)


def beam_search(body: SamplingFields, speculative: bool = False) -> BeamSearch | None:
    """vLLM's beam-search fields: `best_of` (else n) beams, the n best returned. The two that
    shape the search mean nothing without it: a 400, not silence. Beams rank every candidate
    each step, which proposals verified a run at a time cannot serve: with speculative decoding
    on, a beam search is a 400, not a silently slower path."""
    if body.use_beam_search and speculative:
        raise InvalidRequest(
            "beam search cannot run on this cluster: its generation workers use speculative "
            "decoding (cluster.yaml's speculative section)",
            "use_beam_search",
        )
    if not body.use_beam_search:
        for name in ("length_penalty", "early_stopping"):
            if getattr(body, name) is not None:
                raise InvalidRequest(f"{name} applies to beam search: set use_beam_search", name)
        return None
    return BeamSearch(
        width=body.best_of or body.n,
        length_penalty=1.0 if body.length_penalty is None else body.length_penalty,
        early_stopping=False if body.early_stopping is None else body.early_stopping,
    )


def sampling_params(
    body: SamplingFields,
    *,
    defaults: SamplingDefaults,
    vocab_size: int,
    max_tokens: int,
    logprobs: int | None,
    logit_bias: dict[int, float] | None,
    guided: GuidedDecoding | None,
    prompt_logprobs: int | None = None,
    thinking_budget: ThinkingBudget | None = None,
    speculative: bool = False,
) -> SamplingParams:
    """The request's SamplingParams, validated; the route-specific fields are passed in. Beam
    search ranks the model's own distribution: the model's sampling defaults do not apply."""
    beam = beam_search(body, speculative)
    if beam is not None:
        defaults = SamplingDefaults()

    def given_or_default(name: str) -> float:
        value = getattr(body, name)
        return getattr(defaults, name) if value is None else value

    params = SamplingParams(
        n=body.n,
        temperature=given_or_default("temperature"),
        top_p=given_or_default("top_p"),
        top_k=int(given_or_default("top_k")),
        min_p=given_or_default("min_p"),
        repetition_penalty=given_or_default("repetition_penalty"),
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        seed=body.seed,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        logit_bias=logit_bias,
        stop_token_ids=body.stop_token_ids,
        ignore_eos=body.ignore_eos,
        max_tokens=max_tokens,
        min_tokens=body.min_tokens,
        guided=guided,
        thinking_budget=thinking_budget,
        beam=beam,
    )
    params.validate(vocab_size)
    return params
