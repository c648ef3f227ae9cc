"""tools/tiny_arch/harmony.py: the harmony tokenizer (each marker one special id, text round
trips, transformers reads the files as we do) and the training texts (well-formed answers, as
the harmony parser reads them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.harmony import MARKERS
from common.parser_choice import ParserState
from common.tokenizer import Tokenizer, load_tokenizer
from postproc_worker.parsers import ChoiceParsers
from postproc_worker.parsers.tools import ToolCallArguments, ToolCallStart
from tools.tiny_arch.harmony import (
    EOS_TOKEN_IDS,
    HARMONY_TOKENS,
    NUM_IDS,
    RETURN_ID,
    TOKEN_IDS,
    VOCAB_SIZE,
    harmony_training_texts,
    write_harmony_tokenizer,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("harmony-tokenizer")
    write_harmony_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return harmony_training_texts()


def test_each_harmony_token_is_one_special_id(tokenizer: Tokenizer) -> None:
    assert tokenizer.vocab_size == NUM_IDS and VOCAB_SIZE % 64 == 0 and VOCAB_SIZE >= NUM_IDS
    for content in HARMONY_TOKENS:
        assert tokenizer.encode(content) == [TOKEN_IDS[content]]
        assert TOKEN_IDS[content] in tokenizer.special_ids
        assert tokenizer.decode([TOKEN_IDS[content]], skip_special_tokens=False) == content
    assert tokenizer.eos_token_id == RETURN_ID and set(EOS_TOKEN_IDS) <= tokenizer.special_ids
    # markers glued to text still split out as one id each
    ids = tokenizer.encode("x<|channel|>final<|message|>Hi<|return|>")
    assert [TOKEN_IDS["<|channel|>"], TOKEN_IDS["<|message|>"], RETURN_ID] == [
        i for i in ids if i in TOKEN_IDS.values()
    ]


def test_training_texts_round_trip_through_the_tokenizer(
    tokenizer: Tokenizer, texts: list[str]
) -> None:
    for text in texts:
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids, skip_special_tokens=False) == text
        assert len(ids) < 1024
    skipped = tokenizer.decode(tokenizer.encode(texts[0]), skip_special_tokens=True)
    assert not any(m in skipped for m in MARKERS)


def test_transformers_reads_the_same_tokenizer(model_dir: Path, texts: list[str]) -> None:
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(model_dir)
    ours = load_tokenizer(model_dir)
    assert reference.eos_token_id == RETURN_ID and len(reference) == NUM_IDS
    for text in texts[:20]:
        assert reference.encode(text, add_special_tokens=False) == ours.encode(text)


def answer(text: str) -> tuple[str, str, list[tuple[str, object]]]:
    """The harmony parser's reading of a training text's answer (after the last
    `<|start|>assistant` of the prompt)."""
    prompt_end = text.rindex("<|start|>assistant<|channel|>analysis")  # the answer's start
    output = text[prompt_end + len("<|start|>assistant") :]
    parsers = ChoiceParsers(ParserState(reasoning_parser="harmony", tool_parser="harmony"),
                            frozenset())  # fmt: skip
    parsed = parsers.feed(output, final=True)
    calls: list[tuple[str, object]] = []
    arguments = ""
    for event in parsed.events:
        if isinstance(event, ToolCallStart):
            calls.append((event.name, None))
        elif isinstance(event, ToolCallArguments):
            arguments += event.text
    if calls:
        calls = [(calls[0][0], json.loads(arguments))]
    return parsed.reasoning, parsed.content, calls


def test_training_answers_are_analysis_then_final_or_a_call(texts: list[str]) -> None:
    kinds = {"final": 0, "call": 0, "after result": 0}
    for text in texts:
        reasoning, content, calls = answer(text)
        assert reasoning
        tools = "# Tools" in text
        after_result = " to=assistant<|channel|>commentary<|message|>" in text
        if tools and not after_result:
            assert not content and len(calls) == 1
            assert f"type {calls[0][0]} = " in text  # a declared function
            assert text.endswith("<|call|>")
            kinds["call"] += 1
        else:
            assert content and not calls and text.endswith("<|return|>")
            kinds["after result" if after_result else "final"] += 1
    assert min(kinds.values()) >= len(texts) // 6  # every kind well represented
    assert len(set(texts)) == len(texts) and harmony_training_texts() == texts  # seeded
