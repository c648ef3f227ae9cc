"""Verify speculative proposals against the target model's logits at each proposed position.

A sequence with proposals d_1..d_k ran k + 1 positions in one forward: row j holds the target's
logits for the token after d_1..d_j (row 0: after the sequence's own last token).

    rows     0     1     2   ...   k
    checks   d_1   d_2   d_3       (none: a bonus token when every d_j was accepted)

Each row first goes through the sampler's own stages (bias, min_tokens, penalties; temperature,
top-k/p, min-p), as if d_1..d_j had been sampled, so the result has the distribution of plain
decoding:

- greedy: accept d_j while it is the row's argmax; the first mismatch emits the argmax instead.
  The output is token for token what decoding one token a step gives.
- sampled: the proposal is deterministic (q = one-hot at d_j), so exact rejection sampling accepts
  d_j with probability p_j(d_j) and, on rejection, draws from p_j with d_j's mass removed and
  renormalised (the residual max(p - q, 0)). Every emitted token is distributed as p.

Rows past the first rejection are dropped: their KV is rewound by the caller. Seeded requests
draw each position's randomness from draw_generator(seed, position), as the sampler does.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from engine.sampler import (
    SampleResult,
    SamplingState,
    adjust_logits,
    draw_generator,
    row_argmax,
    sample_result,
    warp_logits,
)


@dataclass(slots=True)
class Verified:
    """One step's verdicts, sequence by sequence."""

    token_ids: list[list[int]]  # per sequence: its accepted proposals, then the target's token
    num_accepted: list[int]  # per sequence: proposals accepted
    # the emitted tokens' log-probs (and top alternatives), flattened in the order of token_ids
    logprobs: SampleResult


def verify(logits: torch.Tensor, states: list[SamplingState], drafts: list[list[int]]) -> Verified:
    """logits: (sum(len(d) + 1 for d in drafts), vocab), each sequence's rows back to back."""
    position_states = [
        _at_position(state, draft[:j])
        for state, draft in zip(states, drafts, strict=True)
        for j in range(len(draft) + 1)
    ]
    if logits.shape[0] != len(position_states):
        raise ValueError(f"logits {tuple(logits.shape)} do not match {len(position_states)} rows")
    x = adjust_logits(logits, position_states)  # (rows, vocab)
    greedy_rows = [i for i, s in enumerate(position_states) if s.params.greedy]
    sampled_rows = [i for i, s in enumerate(position_states) if not s.params.greedy]
    targets = row_argmax(x).tolist() if greedy_rows else []  # (rows,)
    probs: dict[int, torch.Tensor] = {}
    if sampled_rows:
        index = torch.tensor(sampled_rows, device=x.device)
        warped = warp_logits(x[index], [position_states[i] for i in sampled_rows])
        probs = dict(zip(sampled_rows, torch.softmax(warped, dim=-1), strict=True))
    token_ids, num_accepted, emitted_rows = [], [], []
    row = 0
    for state, draft in zip(states, drafts, strict=True):
        if state.params.greedy:
            tokens = _verify_greedy(targets[row : row + len(draft) + 1], draft)
        else:
            rows = [probs[row + j] for j in range(len(draft) + 1)]
            tokens = _verify_sampled(rows, draft, state)
        token_ids.append(tokens)
        num_accepted.append(len(tokens) - 1)
        emitted_rows.extend(range(row, row + len(tokens)))
        row += len(draft) + 1
    flat = torch.tensor([t for tokens in token_ids for t in tokens], device=logits.device)
    index = torch.tensor(emitted_rows, device=logits.device)
    logprobs = sample_result(logits[index], flat, [position_states[i] for i in emitted_rows])
    return Verified(token_ids, num_accepted, logprobs)


def _at_position(state: SamplingState, accepted: list[int]) -> SamplingState:
    """The state the sampler would see after `accepted` were sampled: the grammar's, if any, a
    copy that consumed them (the proposals are within the grammar: the scheduler cut them
    there). A thinking budget's sequences do not speculate."""
    if not accepted:
        return state
    matcher = state.matcher
    if matcher is not None:
        matcher = matcher.deep_copy()
        if not matcher.consume_tokens(accepted):
            raise ValueError(f"proposals {accepted} leave the grammar: {matcher.get_error()}")
    return dataclasses.replace(
        state, output_token_ids=state.output_token_ids + accepted, matcher=matcher
    )


def _verify_greedy(targets: list[int], draft: list[int]) -> list[int]:
    """Accept while the proposal is the argmax; then the argmax (a correction or the bonus)."""
    for j, proposed in enumerate(draft):
        if targets[j] != proposed:
            return [*draft[:j], targets[j]]
    return [*draft, targets[len(draft)]]


def _verify_sampled(rows: list[torch.Tensor], draft: list[int], state: SamplingState) -> list[int]:
    """Rejection sampling against a one-hot proposal; rows[j] is p_j, a (vocab,) distribution."""
    start = len(state.output_token_ids)
    for j, proposed in enumerate(draft):
        generator = _generator(state, start + j, rows[j].device)
        u = torch.rand(1, generator=generator, device=rows[j].device)
        if bool(u < rows[j][proposed]):
            continue
        residual = rows[j].clone()
        residual[proposed] = 0.0
        return [*draft[:j], _draw(residual, generator)]
    last = len(draft)
    return [*draft, _draw(rows[last], _generator(state, start + last, rows[last].device))]


def _generator(state: SamplingState, position: int, device: torch.device) -> torch.Generator | None:
    """A seeded request's stream for output `position`; None (the global one) otherwise."""
    return draw_generator(state.seed, position, device) if state.seed is not None else None


def _draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token with probability proportional to `weights` (an exponential race)."""
    noise = torch.empty_like(weights).exponential_(generator=generator)  # (vocab,)
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return int((weights / noise).argmax())
