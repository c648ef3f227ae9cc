"""Grammar constraints in the sampler: each constrained sequence has an llguidance matcher that
says, before every sample, which tokens may come next, and consumes each token sampled.

    frontend: GuidedDecoding(grammar) ──▶ context worker: matcher; first token sampled under it
                                      └─▶ generation worker: a new matcher replays the first token
                                          (Sequence.append_token), then masks every step

The masks are computed on the CPU for the rows that need one, in parallel in llguidance's own
threads (outside the GIL); unconstrained rows cost nothing.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import llguidance
import numpy as np
import torch

from common.errors import InvalidRequest
from common.guided import ll_tokenizer
from common.sampling_params import GuidedDecoding

_NEG_INF = float("-inf")
_BITS = torch.arange(32, dtype=torch.int32)  # bit i of a mask word allows token 32 * word + i


@cache
def _executor() -> llguidance.LLExecutor:
    return llguidance.LLExecutor()


class GrammarCompiler:
    """Builds matchers for one model; its llguidance tokenizer is made on first use (~1 s)."""

    def __init__(self, model_dir: Path, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids

    def matcher(self, spec: GuidedDecoding) -> llguidance.LLMatcher:
        tokenizer = ll_tokenizer(self.model_dir, self.vocab_size, self.eos_token_ids)
        matcher = llguidance.LLMatcher(tokenizer, spec.grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequest(f"{spec.source}: {matcher.get_error()}", spec.source or None)
        return matcher


def apply_grammar_masks(x: torch.Tensor, matchers: list[llguidance.LLMatcher | None]) -> bool:
    """Set the logits of tokens each row's grammar forbids to -inf; True if any row was masked."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return False
    vocab_size = x.shape[1]
    words = np.empty((len(rows), (vocab_size + 31) // 32), dtype=np.int32)  # (rows, words)
    if len(rows) == 1:
        matcher = matchers[rows[0]]
        assert matcher is not None
        matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
    else:  # the rows in parallel, in llguidance's threads, without the GIL
        work = [(matchers[i], j) for j, i in enumerate(rows)]
        _executor().unsafe_compute_mask_ptr(work, words.ctypes.data, words[0].nbytes, len(rows))
    bits = (torch.from_numpy(words).unsqueeze(-1) >> _BITS) & 1  # (rows, words, 32)
    allowed = bits.reshape(len(rows), -1)[:, :vocab_size].bool().to(x.device)  # (rows, vocab)
    index = torch.tensor(rows, device=x.device)
    x[index] = x[index].masked_fill(~allowed, _NEG_INF)
    return True
