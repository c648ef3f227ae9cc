"""Turn one step's logits into next tokens, one row per running sequence.

Order (vLLM / OpenAI semantics), on a float32 copy of the logits:

    logit_bias → min_tokens → grammar mask → a spent thinking budget's forced token
        → repetition penalty → presence/frequency penalties
        → greedy rows: argmax
        → sampled rows: temperature → top_k → top_p → min_p → draw

Every stage is batched over rows and skipped when no row uses it: an all-greedy batch costs a copy
and an argmax, or the argmax alone where no stage applies to any row. Logprobs are read from the
raw logits, before any stage (the model's own), except under a grammar: there they come from the
distribution after the grammar's mask (the seed's rule), renormalized over the tokens the grammar
allows, so a forbidden token never shows up among the top log-probs and the chosen token's
log-prob says how likely it was among the allowed ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import llguidance
import torch

from common.sampling_params import SamplingParams
from engine.guided import apply_grammar_masks
from engine.thinking_budget import ThinkingTracker

_NEG_INF = float("-inf")
_MIN_TEMPERATURE = 1e-5  # dividing by less overflows float32; such rows are greedy in all but name
_MAX_LOGIT = 1e4  # a +inf logit from the model becomes this, so softmax stays finite
_MASK64 = (1 << 64) - 1


def choice_seed(seed: int, index: int = 0) -> int:
    """The random stream of choice `index` of a seeded request: one seed, n distinct choices."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ index)


def draw_generator(stream: int, position: int, device: str | torch.device) -> torch.Generator:
    """The generator for output token `position` of a stream. A draw depends on (seed, choice,
    position) only, so a context worker's first token and a generation worker's later ones come
    out as in one process, and a retried or recomputed request repeats itself."""
    generator = torch.Generator(device=device)
    generator.manual_seed(_splitmix64(stream ^ position))
    return generator


def _splitmix64(x: int) -> int:
    """A 64-bit mixer (SplitMix64's finaliser): nearby inputs give unrelated seeds."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


@dataclass(slots=True)
class SamplingState:
    """What the sampler reads about one running sequence; the scheduler owns it, appends outputs."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None  # choice_seed(params.seed, index) when seeded
    eos_token_ids: frozenset[int] = frozenset()  # the model's EOS ids, masked during min_tokens
    matcher: llguidance.LLMatcher | None = None  # params.guided's grammar state (engine/guided.py)
    thinking: ThinkingTracker | None = None  # params.thinking_budget's state

    def append(self, token_id: int) -> None:
        """Record a sampled (or replayed) token; the grammar and the thinking budget, if any,
        consume it too."""
        self.output_token_ids.append(token_id)
        if self.matcher is not None:
            self.matcher.consume_token(token_id)
        if self.thinking is not None:
            self.thinking.append(token_id)


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]  # one per row
    logprobs: list[float] | None  # raw logprob of each sampled token; None when no row asked
    # The k = params.logprobs best (id, logprob) per row, [] for rows that did not ask.
    top_logprobs: list[list[tuple[int, float]]] | None


class Sampler:
    """Stateless across steps: everything that persists per sequence lives in its SamplingState."""

    def __call__(self, logits: torch.Tensor, states: list[SamplingState]) -> SampleResult:
        """logits: (num_rows, vocab_size), one row per state, in the same order."""
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(states)} states")
        token_ids = _plain_greedy_choice(logits, states)
        if token_ids is None:
            x = adjust_logits(logits, states)  # (num_rows, vocab_size)
            token_ids = _choose(x, states)  # (num_rows,)
        return sample_result(logits, token_ids, states)


def _plain_greedy_choice(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor | None:
    """Every row's argmax of the raw logits, where every row is greedy and no stage applies to
    it (no bias, min_tokens met, no grammar, no thinking budget, no penalty) and each row's
    maximum is finite (no NaN, no +inf, not all -inf): then it is what the stages' copy, whose
    nan_to_num changes nothing else, would pick. None otherwise. It spares the copy and the
    stages' calls: on the Zen 4 VM the sampler's call took 110 us for 144 at one SmolLM2
    sequence, 0.76 ms for 1.17 at 32 (the Python after a decode step's weights stream runs from
    a cold cache: each call costs there several times what it costs warm)."""
    for state in states:
        params = state.params
        if (
            not params.greedy
            or params.logit_bias
            or len(state.output_token_ids) < params.min_tokens
            or state.matcher is not None
            or state.thinking is not None
            or params.repetition_penalty != 1.0
            or params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0
        ):
            return None
    if logits.device.type == "cpu" and logits.dtype == torch.float32:  # numpy: fewer, lighter calls
        rows = logits.numpy()
        if not all(math.isfinite(top) for top in rows.max(axis=-1).tolist()):  # a NaN is the max
            return None
        return torch.from_numpy(rows.argmax(axis=-1))
    token_ids = row_argmax(logits.float())
    if not torch.isfinite(logits.gather(1, token_ids.unsqueeze(1))).all():
        return None
    return token_ids


def adjust_logits(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """Bias, min_tokens and penalties: the stages that apply to greedy and sampled rows alike."""
    # A copy (nan_to_num never aliases), with NaN and +inf made harmless for the softmax below.
    x = torch.nan_to_num(logits.float(), nan=_NEG_INF, posinf=_MAX_LOGIT, neginf=_NEG_INF)
    # The raw argmax a row falls back on if its masks leave nothing: only where a row can be
    # masked or is sampled (an argmax of a large batch's logits costs ~1 ms on one core).
    may_revive = not all(s.params.greedy for s in states) or any(
        s.matcher is not None or len(s.output_token_ids) < s.params.min_tokens for s in states
    )
    fallback = row_argmax(x).unsqueeze(1) if may_revive else None  # (num_rows, 1)
    x = _apply_logit_bias(x, states)
    masked = _apply_min_tokens(x, states)
    masked |= apply_grammar_masks(x, [s.matcher for s in states])
    _apply_forced_tokens(x, states)
    x = _apply_repetition_penalty(x, states)
    x = _apply_presence_frequency(x, states)
    if fallback is not None:
        x = _revive_dead_rows(x, fallback)
    return x


def _apply_forced_tokens(x: torch.Tensor, states: list[SamplingState]) -> None:
    """A row whose thinking budget is spent gets one choice: the end marker's next token
    (whatever the temperature, which then samples from that one token)."""
    for i, state in enumerate(states):
        forced = state.thinking.forced_token() if state.thinking is not None else None
        if forced is not None:
            keep = x[i, forced].clone()
            x[i].fill_(_NEG_INF)
            x[i, forced] = keep if torch.isfinite(keep) else 0.0


def warp_logits(x: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """Temperature and the truncation filters: rows are sampled from softmax of the result."""
    x = _apply_temperature(x, states)
    x = _apply_top_k(x, states)
    x = _apply_top_p(x, states)
    return _apply_min_p(x, states)


def _choose(x: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    greedy = [s.params.greedy for s in states]
    if all(greedy):
        return row_argmax(x)  # (num_rows,); ties go to the lowest id, like HF
    if not any(greedy):
        return _sample(x, states)
    sampled_rows = [i for i, is_greedy in enumerate(greedy) if not is_greedy]
    index = torch.tensor(sampled_rows, device=x.device)  # (num_sampled,)
    token_ids = row_argmax(x)  # (num_rows,)
    token_ids[index] = _sample(x[index], [states[i] for i in sampled_rows])
    return token_ids


def _sample(x: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """argmax(p / q) with q ~ Exp(1) draws from p (an exponential race), one noise row per row."""
    probs = torch.softmax(warp_logits(x, states), dim=-1)  # (num_sampled, vocab_size)
    noise = torch.empty_like(probs)  # (num_sampled, vocab_size)
    seeded = [
        (i, s.seed, len(s.output_token_ids)) for i, s in enumerate(states) if s.seed is not None
    ]
    if len(seeded) < len(states):
        noise.exponential_()  # unseeded rows share one draw from the global generator
    for i, stream, position in seeded:
        # A seeded row draws from its own stream only, so batch composition cannot change it.
        noise[i].exponential_(generator=draw_generator(stream, position, x.device))
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)  # a zero draw would make 0 / 0 = NaN
    return row_argmax(probs / noise)  # (num_sampled,)


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (rows,) int64, the first of equal maxima (a NaN counts as the largest),
    as torch.argmax(dim=-1). A CPU float32 matrix goes through numpy's, which is vectorized where
    torch's CPU argmax is not: a 49152-token row took 54 us in torch and 6 in numpy on one Zen 4
    core, eight rows 370 us and 29, every step."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2:
        return torch.from_numpy(x.numpy().argmax(axis=-1))
    return x.argmax(dim=-1)


def _apply_logit_bias(x: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    for i, state in enumerate(states):
        for token_id, bias in (state.params.logit_bias or {}).items():
            rows.append(i)
            cols.append(int(token_id))
            values.append(float(bias))
    if rows:
        index = (_long(rows, x), _long(cols, x))
        x.index_put_(index, torch.tensor(values, device=x.device), accumulate=True)
    return x


def _apply_min_tokens(x: torch.Tensor, states: list[SamplingState]) -> bool:
    """Forbid every way to stop while the output is shorter than min_tokens; True if any masked."""
    rows: list[int] = []
    cols: list[int] = []
    for i, state in enumerate(states):
        params = state.params
        if len(state.output_token_ids) >= params.min_tokens:
            continue
        banned = set(params.stop_token_ids)
        if not params.ignore_eos:
            banned |= state.eos_token_ids
        rows.extend([i] * len(banned))
        cols.extend(banned)
    if rows:
        x[_long(rows, x), _long(cols, x)] = _NEG_INF
    return bool(rows)


def _apply_repetition_penalty(x: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """HF semantics: a seen token's logit is divided by the penalty if positive, else multiplied."""
    penalties = [s.params.repetition_penalty for s in states]
    if all(p == 1.0 for p in penalties):
        return x
    token_lists = [
        s.prompt_token_ids + s.output_token_ids if p != 1.0 else []
        for s, p in zip(states, penalties, strict=True)
    ]
    seen = _token_counts(token_lists, x) > 0  # (num_rows, vocab_size)
    penalty = _column(penalties, x)  # (num_rows, 1)
    penalised = torch.where(x < 0, x * penalty, x / penalty)  # (num_rows, vocab_size)
    return torch.where(seen, penalised, x)


def _apply_presence_frequency(x: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """OpenAI semantics over output tokens: logit -= presence * (count > 0) + frequency * count."""
    presence = [s.params.presence_penalty for s in states]
    frequency = [s.params.frequency_penalty for s in states]
    used = [p != 0.0 or f != 0.0 for p, f in zip(presence, frequency, strict=True)]
    if not any(used):
        return x
    token_lists = [s.output_token_ids if u else [] for s, u in zip(states, used, strict=True)]
    counts = _token_counts(token_lists, x)  # (num_rows, vocab_size)
    x -= _column(frequency, x) * counts + _column(presence, x) * (counts > 0)
    return x


def _revive_dead_rows(x: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """A row whose masks removed every token keeps its raw argmax: softmax never sees all -inf."""
    dead = x.amax(dim=-1, keepdim=True) == _NEG_INF  # (num_rows, 1)
    kept = torch.where(dead, 0.0, x.gather(1, fallback))  # (num_rows, 1)
    return x.scatter_(1, fallback, kept)


def _apply_temperature(x: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    temperatures = [s.params.temperature for s in states]
    if all(t == 1.0 for t in temperatures):
        return x
    return x.div_(_column(temperatures, x).clamp_min_(_MIN_TEMPERATURE))


def _apply_top_k(x: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """Keep logits >= the k-th largest (ties at the k-th are kept, like HF's TopKLogitsWarper)."""
    vocab_size = x.shape[1]
    ks = [s.params.top_k if 0 < s.params.top_k < vocab_size else 0 for s in states]
    if not any(ks):
        return x
    max_k = max(ks)
    top = torch.topk(x, max_k, dim=-1).values  # (num_rows, max_k), descending
    kth_index = _long([(k or max_k) - 1 for k in ks], x).unsqueeze(1)  # (num_rows, 1)
    kth = top.gather(1, kth_index)  # (num_rows, 1)
    disabled = torch.tensor([k == 0 for k in ks], device=x.device).unsqueeze(1)  # (num_rows, 1)
    kth.masked_fill_(disabled, _NEG_INF)
    return x.masked_fill_(x < kth, _NEG_INF)


def _apply_top_p(x: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """Drop the least likely tokens whose total mass is <= 1 - top_p; the best one always stays."""
    top_ps = [s.params.top_p for s in states]
    if all(p >= 1.0 for p in top_ps):
        return x
    sorted_logits, order = x.sort(dim=-1)  # (num_rows, vocab_size), ascending
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # (num_rows, vocab_size)
    remove_sorted = cumulative <= _column([1.0 - p for p in top_ps], x)  # (num_rows, vocab_size)
    remove_sorted[:, -1] = False
    remove = torch.empty_like(remove_sorted).scatter_(1, order, remove_sorted)  # in vocab order
    return x.masked_fill_(remove, _NEG_INF)


def _apply_min_p(x: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """Drop tokens less likely than min_p times the most likely one."""
    min_ps = [s.params.min_p for s in states]
    if all(m == 0.0 for m in min_ps):
        return x
    probs = x.softmax(dim=-1)  # (num_rows, vocab_size)
    threshold = probs.amax(dim=-1, keepdim=True) * _column(min_ps, x)  # (num_rows, 1)
    return x.masked_fill_(probs < threshold, _NEG_INF)


def sample_result(
    logits: torch.Tensor, token_ids: torch.Tensor, states: list[SamplingState]
) -> SampleResult:
    """The chosen tokens with their log-probs (and top alternatives) from the raw `logits`, for
    the rows that asked (also the speculative verifier's, engine/spec_verify.py)."""
    ks = [s.params.logprobs for s in states]
    if all(k is None for k in ks):
        return SampleResult(token_ids.tolist(), None, None)
    source = logits.float()  # (num_rows, vocab_size)
    matchers = [s.matcher if k is not None else None for s, k in zip(states, ks, strict=True)]
    if any(m is not None for m in matchers):
        source = source.clone()  # a float32 logits tensor is not copied by .float()
        apply_grammar_masks(source, matchers)  # the matchers have not consumed this step's token
    logprobs = torch.log_softmax(source, dim=-1)  # raw, or after the grammar's mask
    logprobs = torch.nan_to_num(logprobs, nan=_NEG_INF, neginf=_NEG_INF)  # a NaN row reports -inf
    chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)  # (num_rows,)
    max_k = min(max(k or 0 for k in ks), logprobs.shape[1])
    top: list[list[tuple[int, float]]] = [[] for _ in states]
    if max_k > 0:
        values, indices = torch.topk(logprobs, max_k, dim=-1)  # (num_rows, max_k), descending
        value_rows, index_rows = values.tolist(), indices.tolist()
        for i, k in enumerate(ks):
            if k:
                top[i] = list(zip(index_rows[i][:k], value_rows[i][:k], strict=True))
    return SampleResult(token_ids.tolist(), chosen.tolist(), top)


def _token_counts(token_lists: list[list[int]], x: torch.Tensor) -> torch.Tensor:
    """(num_rows, vocab_size) occurrence counts; ids past the logits (padded embeddings) drop."""
    num_rows, vocab_size = x.shape
    width = max((len(ids) for ids in token_lists), default=0)
    counts = torch.zeros(num_rows, vocab_size + 1, device=x.device)  # last column absorbs padding
    if width == 0:
        return counts[:, :vocab_size]
    padded = [ids + [vocab_size] * (width - len(ids)) for ids in token_lists]
    index = _long(padded, x).clamp_(max=vocab_size)  # (num_rows, width)
    counts.scatter_add_(1, index, torch.ones(index.shape, device=x.device))
    return counts[:, :vocab_size]


def _column(values: list[float], x: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=x.device).unsqueeze(1)  # (num_rows, 1)


def _long(values: list[int] | list[list[int]], x: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=x.device)
