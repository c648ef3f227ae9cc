"""Draft-free speculative proposals (prompt lookup): the sequence's last n tokens, found earlier in
its own prompt + output, propose the tokens that followed them there.

    tokens   a b c d x y a b c ?        n = 3: suffix "a b c" also starts at 0
             └─match─┘ └┬┘              proposal: d x y (up to k tokens after the match)

Longer suffixes are tried first (prompt_lookup_max down to prompt_lookup_min), and within one n
the latest earlier occurrence with k tokens after it wins (the recent text is the likelier to be
copied next), else the earliest (the one with the most after it). Costs one
vectorised scan of the sequence per n, no model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

if TYPE_CHECKING:
    from engine.sequence import Sequence


def propose_ngram(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` proposed next tokens for `token_ids` ([] when no suffix of length min_n..max_n
    occurs earlier, or k < 1)."""
    num_tokens = len(token_ids)
    if k < 1 or num_tokens < min_n + 1:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, num_tokens - 1), min_n - 1, -1):
        suffix = tokens[num_tokens - n :]
        # windows starting at 0 .. num_tokens - n - 1: each has at least one token after it
        windows = sliding_window_view(tokens[: num_tokens - 1], n)  # (num_tokens - n, n)
        starts = np.flatnonzero((windows == suffix).all(axis=1))
        if starts.size:
            # the latest match with k tokens after it, else the earliest (the most after it)
            full = starts[starts + n + k <= num_tokens]
            follow = int(full[-1] if full.size else starts[0]) + n
            return token_ids[follow : follow + k]
    return []


class NgramProposer:
    """The scheduler's proposer for `method: ngram` (see engine/draft_proposer.py for the other):
    each sequence's proposals from its own tokens, no state kept between steps."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, wanted: list[tuple[Sequence, int]]) -> list[list[int]]:
        return [propose_ngram(seq.token_ids, k, self.min_n, self.max_n) for seq, k in wanted]

    def forget(self, seq_id: str) -> None:
        pass  # nothing kept per sequence
