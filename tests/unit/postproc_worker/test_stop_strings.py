"""Stop strings: trimmed before the match, never partly shown, found in any split of a stream."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.tokenizer import load_tokenizer
from postproc_worker.detokenizer import IncrementalDetokenizer
from postproc_worker.stop_strings import StopStringMatcher


def partitions(text: str) -> Iterator[list[str]]:
    """Every way to cut `text` into consecutive non-empty pieces."""
    for cuts in itertools.product([False, True], repeat=len(text) - 1):
        pieces, start = [], 0
        for i, cut in enumerate(cuts, start=1):
            if cut:
                pieces.append(text[start:i])
                start = i
        yield [*pieces, text[start:]]


def run(stop: list[str], pieces: list[str]) -> tuple[list[str], str | None]:
    """Feed the pieces as a stream would; flush at the end when nothing matched."""
    matcher = StopStringMatcher(stop)
    shown = [matcher.feed(piece) for piece in pieces]
    if matcher.matched is None:
        shown.append(matcher.flush())
    return shown, matcher.matched


def assert_never_retracted(shown: list[str], final: str) -> None:
    """Everything shown so far is a prefix of the final text: no partial stop string was sent."""
    so_far = ""
    for piece in shown:
        so_far += piece
        assert final.startswith(so_far)


@pytest.mark.parametrize(
    ("text", "stop", "expected", "matched"),
    [
        ("abc###def", ["###"], "abc", "###"),
        ("ab##c#d##", ["###"], "ab##c#d##", None),
        ("stop at start", ["stop"], "", "stop"),
        ("x END y STOP", ["STOP", "END"], "x ", "END"),  # the earliest match wins
        ("aaab", ["aab"], "a", "aab"),  # overlapping prefix of the stop string
        ("你好世界。再见", ["世界"], "你好", "世界"),
        ("line\n\nnext", ["\n\n"], "line", "\n\n"),
    ],
)
def test_every_split_of_the_stream_gives_the_same_result(
    text: str, stop: list[str], expected: str, matched: str | None
) -> None:
    for pieces in partitions(text):
        shown, found = run(stop, pieces)
        assert "".join(shown) == expected, pieces
        assert found == matched
        assert_never_retracted(shown, expected)


def test_a_possible_start_of_a_stop_string_is_held_back() -> None:
    matcher = StopStringMatcher(["</answer>"])
    assert matcher.feed("42 </ans") == "42 "
    assert matcher.feed("wer") == ""
    assert matcher.feed("s are") == "</answers are"  # not a stop string after all: released
    assert matcher.matched is None


def test_held_text_is_released_when_the_choice_ends_otherwise() -> None:
    matcher = StopStringMatcher(["###"])
    assert matcher.feed("done ##") == "done "
    assert matcher.flush() == "##"
    assert matcher.flush() == ""


def test_nothing_more_is_shown_after_a_match() -> None:
    matcher = StopStringMatcher(["."])
    assert matcher.feed("One. Two.") == "One"
    assert matcher.matched == "."
    assert matcher.feed("more") == ""


def test_without_stop_strings_text_passes_through() -> None:
    matcher = StopStringMatcher(["", ""])  # empty stop strings would match everywhere: ignored
    assert matcher.feed("ab") == "ab"
    assert matcher.flush() == ""
    assert matcher.matched is None


def test_the_longest_possible_prefix_is_held_across_several_stop_strings() -> None:
    matcher = StopStringMatcher(["xyz", "yzw"])
    assert matcher.feed("ab xy") == "ab "  # "xy" could start "xyz"
    assert matcher.feed("z") == ""
    assert matcher.matched == "xyz"


@pytest.mark.parametrize(
    ("text", "stop", "expected"),
    [
        ("The answer is 42.\nQuestion: next", ["\nQuestion:"], "The answer is 42."),
        ("猫は可愛い。犬も可愛い。", ["犬も"], "猫は可愛い。"),  # tokens split the CJK characters
        ("party 🎉🎉 time", ["🎉 t"], "party 🎉"),
    ],
)
def test_stop_strings_across_real_token_boundaries(
    tiny_model_path: Path, text: str, stop: list[str], expected: str
) -> None:
    """Token ids from the real tokenizer, cut into engine steps at every pair of boundaries."""
    tokenizer = load_tokenizer(tiny_model_path)
    token_ids = tokenizer.encode(text)
    assert len(token_ids) > 4
    for i, j in itertools.combinations(range(1, len(token_ids)), 2):
        detokenizer = IncrementalDetokenizer(tokenizer)
        matcher = StopStringMatcher(stop)
        shown = []
        for step in (token_ids[:i], token_ids[i:j], token_ids[j:]):
            shown.append(matcher.feed(detokenizer.add(step)))
            if matcher.matched:
                break
        assert matcher.matched == stop[0]
        assert "".join(shown) == expected
        assert_never_retracted(shown, expected)
