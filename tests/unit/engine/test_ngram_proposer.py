"""Prompt-lookup proposals: the longest suffix found earlier proposes what followed it."""

from __future__ import annotations

from engine.ngram_proposer import propose_ngram


def test_the_longest_suffix_match_proposes_what_followed_it() -> None:
    # "2 3" occurs after 9 (followed by 7 7) and, as "1 2 3", at 0 (followed by 4 5 6):
    # the 3-gram wins over the later 2-gram
    tokens = [1, 2, 3, 4, 5, 6, 9, 2, 3, 7, 7, 1, 2, 3]
    assert propose_ngram(tokens, 3, 1, 3) == [4, 5, 6]
    assert propose_ngram(tokens, 3, 1, 2) == [7, 7, 1]  # at most 2-grams: the latest "2 3"


def test_the_latest_match_with_k_tokens_after_it_wins_else_the_earliest() -> None:
    tokens = [5, 1, 5, 2, 5, 3, 5]
    assert propose_ngram(tokens, 1, 1, 1) == [3]  # the latest 5 with a token after it
    assert propose_ngram(tokens, 2, 1, 1) == [3, 5]
    assert propose_ngram(tokens, 3, 1, 1) == [2, 5, 3]  # the latest with three after it
    assert propose_ngram([7, 7, 7, 7], 3, 1, 3) == [7]  # only the earliest has any after it


def test_no_proposal_without_a_match_or_room() -> None:
    assert propose_ngram([1, 2, 3, 4], 3, 1, 3) == []
    assert propose_ngram([1, 2, 1], 0, 1, 3) == []
    assert propose_ngram([1], 3, 1, 3) == []
    assert propose_ngram([1, 2, 3, 1, 2], 3, 3, 3) == []  # below prompt_lookup_min


def test_the_proposal_stops_at_the_end_of_the_sequence() -> None:
    assert propose_ngram([4, 8, 9, 4], 5, 1, 2) == [8, 9, 4]
