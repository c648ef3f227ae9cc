"""One sequence being generated: its tokens, how far the KV cache has computed them, and why it
ended.

A request with n > 1 becomes n sequences that share the prompt (and its cached blocks); a beam
search, one sequence per live beam (engine/beam_search.py).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from common.block_hash import ExtraKey
from common.sampling_params import SamplingParams
from engine.sampler import SamplingState

if TYPE_CHECKING:
    from engine.beam_search import BeamGroup


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PULLING = "pulling"  # blocks allocated, KV arriving over NIXL; not schedulable yet
    HELD = "held"  # prefill-only: done, blocks kept (leased) until the worker releases them
    PARKED = "parked"  # a beam that offered its continuations, blocks kept, until its group selects
    FINISHED = "finished"


@dataclass(slots=True)
class Sequence:
    seq_id: str
    request_id: str
    index: int  # choice index within the request
    token_ids: list[int]  # prompt followed by the tokens generated so far
    num_prompt_tokens: int
    sampling: SamplingState
    extra_keys: tuple[ExtraKey, ...] = ()  # salts the prefix-cache hashes (cache_salt, lora)
    arrival_order: int = 0
    priority: int = 0  # higher runs first (the request's `priority`), FIFO within a level
    arrival_time: float = 0.0  # time.monotonic() when queued, for the queue-time metric
    admitted_at: float = 0.0  # time.monotonic() when it first ran (admitted, or its pull done)
    queue_s: float = 0.0  # arrival → first admission
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_prompt_tokens: int = 0  # prompt tokens served by a prefix-cache hit at admission
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None  # stop | length | abort
    prefill_only: bool = False  # context worker: stop after the first token, keep the blocks
    # The log-prob of prompt token i + 1 given the tokens up to i, and its top alternatives, for
    # i = 0, 1, ... as far as computed (SamplingParams.prompt_logprobs); handed out with the
    # first sampled token.
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    beam: BeamGroup | None = None  # its request's beam search (SamplingParams.beam)
    beam_score: float = 0.0  # the beam's cumulative log-prob
    # speculative proposals scheduled after the last token this step (engine/ngram_proposer.py);
    # the step's verdict (engine/spec_verify.py) empties it
    draft_token_ids: list[int] = field(default_factory=list)
    # its images' encoded rows, each at its run of placeholders (engine/prompt_images.py)
    images: list[tuple[int, torch.Tensor]] = field(default_factory=list)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Has prompt log-probs still to compute (choice 0 only: the others share its prompt)."""
        return (
            self.params.prompt_logprobs is not None
            and self.index == 0
            and len(self.prompt_logprobs) < self.num_prompt_tokens - 1
        )

    @property
    def queue_key(self) -> tuple[int, int]:
        """The scheduler's order: higher priority first, then earlier arrival."""
        return (-self.priority, self.arrival_order)

    @property
    def params(self) -> SamplingParams:
        return self.sampling.params

    @property
    def output_token_ids(self) -> list[int]:
        return self.sampling.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.sampling.append(token_id)
