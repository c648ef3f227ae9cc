"""Incremental detokenization against the tiny model's real byte-level BPE tokenizer."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from common.tokenizer import Tokenizer, load_tokenizer
from postproc_worker.detokenizer import IncrementalDetokenizer

TEXTS = [
    "The lighthouse keeper woke before dawn, and walked down to the harbour.",
    "你好，世界！今天的天气很好，我们去公园散步吧。",
    "Emoji: 🎉👍🏽 family 👨‍👩‍👧 flags 🇫🇷🇯🇵 done.",
    "Mixed: naïve café, Ελληνικά, русский, עברית, हिन्दी, 한국어 and 日本語.",
    "def f(x):\n    return x ** 2  # ∑ → ∞\n",
    "<|im_start|>assistant\n<think>plan</think>answer<|im_end|><|endoftext|>",
    "Literal replacement char \ufffd in the middle.",
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path: Path) -> Tokenizer:
    return load_tokenizer(tiny_model_path)


def stream(detokenizer: IncrementalDetokenizer, token_ids: list[int], step: int = 1) -> list[str]:
    deltas = [detokenizer.add(token_ids[i : i + step]) for i in range(0, len(token_ids), step)]
    return [*deltas, detokenizer.flush()]


def test_fixture_texts_contain_tokens_that_split_characters(tokenizer: Tokenizer) -> None:
    split = 0
    for text in TEXTS:
        for token_id in tokenizer.encode(text):
            try:
                tokenizer.token_bytes(token_id).decode("utf-8")
            except UnicodeDecodeError:
                split += 1
    assert split > 20  # CJK and emoji really come as partial-character tokens


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_deltas_join_to_the_full_decode(
    tokenizer: Tokenizer, text: str, skip_special_tokens: bool
) -> None:
    token_ids = tokenizer.encode(text)
    deltas = stream(
        IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens), token_ids
    )
    full = tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
    assert "".join(deltas) == full
    if "\ufffd" not in full:
        assert not any("\ufffd" in d for d in deltas)


def test_special_tokens_are_skipped_or_kept(tokenizer: Tokenizer) -> None:
    token_ids = tokenizer.encode("<|im_start|>user<|im_end|><think>x</think>")
    skipped = "".join(stream(IncrementalDetokenizer(tokenizer), token_ids))
    kept = "".join(stream(IncrementalDetokenizer(tokenizer, skip_special_tokens=False), token_ids))
    assert skipped == "user<think>x</think>"  # think markers are added but not special
    assert kept == "<|im_start|>user<|im_end|><think>x</think>"


@pytest.mark.parametrize("step", [2, 3, 7])
def test_multi_token_steps_give_the_same_text(tokenizer: Tokenizer, step: int) -> None:
    token_ids = tokenizer.encode("".join(TEXTS[:-1]))  # all but the literal U+FFFD
    deltas = stream(IncrementalDetokenizer(tokenizer), token_ids, step)
    assert "".join(deltas) == tokenizer.decode(token_ids)
    assert not any("\ufffd" in d for d in deltas)


def test_random_token_ids_including_invalid_utf8(tokenizer: Tokenizer) -> None:
    rng = random.Random(7)
    for _ in range(200):
        token_ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 40))]
        for skip in (True, False):
            deltas = stream(IncrementalDetokenizer(tokenizer, skip_special_tokens=skip), token_ids)
            assert "".join(deltas) == tokenizer.decode(token_ids, skip_special_tokens=skip)


def test_incomplete_character_is_held_then_flushed(tokenizer: Tokenizer) -> None:
    token_ids = tokenizer.encode("ok 🎉")
    detokenizer = IncrementalDetokenizer(tokenizer)
    partial = [detokenizer.add([t]) for t in token_ids[:-1]]
    assert "".join(partial) == "ok "  # the emoji's first bytes wait for the rest
    assert detokenizer.flush() == tokenizer.decode(token_ids[:-1])[len("ok ") :]


def test_prompt_context_does_not_change_byte_level_output(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode("Écrivez en français: ")
    token_ids = tokenizer.encode("très bien, 謝謝")
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids=prompt)
    assert "".join(stream(detokenizer, token_ids)) == tokenizer.decode(token_ids)


def test_prompt_ending_mid_character_is_not_used_as_context(tokenizer: Tokenizer) -> None:
    emoji = tokenizer.encode("🎉")
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids=emoji[:-1])
    assert "".join(stream(detokenizer, tokenizer.encode("after"))) == "after"


def test_work_per_step_does_not_grow_with_output_length(tokenizer: Tokenizer) -> None:
    token_ids = tokenizer.encode(" ".join(TEXTS) * 20)
    decoded = 0
    real_decode = tokenizer.decode

    def counting_decode(ids: list[int], skip_special_tokens: bool = True) -> str:
        nonlocal decoded
        decoded += len(ids)
        return real_decode(ids, skip_special_tokens)

    tokenizer.decode = counting_decode  # type: ignore[method-assign]
    try:
        deltas = stream(IncrementalDetokenizer(tokenizer), token_ids)
    finally:
        del tokenizer.decode
    assert "".join(deltas) == tokenizer.decode(token_ids)
    assert len(token_ids) > 2000
    assert decoded < 12 * len(token_ids)  # a small window per step, not the whole output


def test_num_chars_counts_emitted_characters(tokenizer: Tokenizer) -> None:
    detokenizer = IncrementalDetokenizer(tokenizer)
    text = "".join(stream(detokenizer, tokenizer.encode(TEXTS[1])))
    assert detokenizer.num_chars == len(text)


def test_load_tokenizer_reads_tokenizer_config(tokenizer: Tokenizer) -> None:
    assert tokenizer.vocab_size == 4096
    assert tokenizer.eos_token_id == tokenizer.token_to_id("<|im_end|>")
    assert tokenizer.pad_token_id == tokenizer.token_to_id("<|endoftext|>")
    assert tokenizer.bos_token_id is None
    assert tokenizer.token_to_id("<|im_start|>") in tokenizer.special_ids
    assert tokenizer.token_to_id("<think>") not in tokenizer.special_ids
    assert tokenizer.chat_template is not None and "<|im_start|>" in tokenizer.chat_template
    assert tokenizer.encode("<|im_end|>") == [tokenizer.eos_token_id]
    assert tokenizer.id_to_token(tokenizer.encode(" world")[0]) == "Ġworld"


def test_token_bytes_are_exact_for_partial_characters(tokenizer: Tokenizer) -> None:
    text = TEXTS[1] + TEXTS[2]
    token_ids = tokenizer.encode(text)
    assert b"".join(tokenizer.token_bytes(t) for t in token_ids) == text.encode()
