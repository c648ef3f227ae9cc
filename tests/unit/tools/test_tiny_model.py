"""The tiny model as transformers sees it: it loads, tokenizes like Qwen, renders Qwen3 chats, and
its greedy output is not degenerate."""

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from engine.builtin_build import ensure_builtin
from tools.tiny_model.build import TEST_PROMPTS, build_tiny_model, load_corpus
from tools.tiny_model.tokenizer import (
    ADDED_TOKENS,
    NUM_KEPT_RANKS,
    QWEN_SPLIT_PATTERN,
    load_qwen_ranks,
)

ROUND_TRIP_TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def f(x: int) -> int:\n    return x ** 2  # square\n\n\n",
    "日本語のテキストと中文文本，还有한국어.",
    "Emoji: 🤖🎉👩‍👩‍👧 and accents: café, naïve, Ångström, ß.",
    "   leading spaces,\ttabs,\r\nCRLF and trailing   ",
    "numbers 1234567890 3.14159 -42 1e-6",
    '<|im_start|>user\nHi<|im_end|>\n<tool_call>\n{"name": "f"}\n</tool_call><think>x</think>',
    "",
]

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path: Path):
    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="module")
def model(tiny_model_path: Path):
    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


def render(tokenizer, messages: list[dict], **kwargs) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


def test_model_directory_holds_the_hugging_face_files(tiny_model_path: Path) -> None:
    names = {p.name for p in tiny_model_path.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    } <= names
    assert "chat_template" in json.loads((tiny_model_path / "tokenizer_config.json").read_text())


def test_config_is_a_small_qwen3_with_grouped_query_attention(
    tiny_model_path: Path, tokenizer
) -> None:
    config = AutoConfig.from_pretrained(tiny_model_path)
    assert config.model_type == "qwen3"
    assert config.num_key_value_heads < config.num_attention_heads
    assert config.num_attention_heads % config.num_key_value_heads == 0
    assert config.head_dim == 32
    assert config.vocab_size == len(tokenizer) == NUM_KEPT_RANKS + len(ADDED_TOKENS)
    assert config.vocab_size % 64 == 0


def test_model_loads_with_all_weights(model) -> None:
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.dtype == torch.float32
    num_params = sum(p.numel() for p in model.parameters())
    assert 1_000_000 < num_params < 10_000_000
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_tokenizer_round_trips_text(tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text


def test_transformers_tokenizer_encodes_like_tokenizer_json(
    tiny_model_path: Path, tokenizer
) -> None:
    raw = Tokenizer.from_file(str(tiny_model_path / "tokenizer.json"))
    for text in ROUND_TRIP_TEXTS:
        assert tokenizer.encode(text, add_special_tokens=False) == raw.encode(text).ids


def test_tokenizer_matches_tiktoken_bpe_on_the_kept_ranks(tokenizer) -> None:
    tiktoken = pytest.importorskip("tiktoken")
    special = {content: NUM_KEPT_RANKS + i for i, (content, _) in enumerate(ADDED_TOKENS)}
    reference = tiktoken.Encoding(
        "qwen-first-ranks",
        pat_str=QWEN_SPLIT_PATTERN,
        mergeable_ranks=load_qwen_ranks(),
        special_tokens=special,
    )
    texts = [*ROUND_TRIP_TEXTS, load_corpus()]
    for text in texts:
        expected = reference.encode(text, allowed_special="all")
        assert tokenizer.encode(text, add_special_tokens=False) == expected


def test_added_tokens_follow_the_ranks_and_only_chat_markers_are_special(tokenizer) -> None:
    for i, (content, _) in enumerate(ADDED_TOKENS):
        assert tokenizer.convert_tokens_to_ids(content) == NUM_KEPT_RANKS + i
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    ids = tokenizer.encode("<|im_start|>a<tool_call>b</tool_call><think>c</think><|im_end|>")
    marker = tokenizer.convert_tokens_to_ids
    letter = tokenizer.encode  # a single ASCII letter is one byte-level token
    assert ids == [
        marker("<|im_start|>"), *letter("a"), marker("<tool_call>"), *letter("b"),
        marker("</tool_call>"), marker("<think>"), *letter("c"), marker("</think>"),
        marker("<|im_end|>"),
    ]  # fmt: skip
    text = tokenizer.decode(ids, skip_special_tokens=True)
    assert text == "a<tool_call>b</tool_call><think>c</think>"


def test_chat_template_renders_chatml_with_generation_prompt(tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": [{"type": "text", "text": "Bye"}]},
    ]
    assert render(tokenizer, messages, add_generation_prompt=True) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_chat_template_thinking_switch(tokenizer) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    thinking = render(tokenizer, messages, add_generation_prompt=True)
    not_thinking = render(tokenizer, messages, add_generation_prompt=True, enable_thinking=False)
    assert thinking.endswith("<|im_start|>assistant\n")
    assert not_thinking == thinking + "<think>\n\n</think>\n\n"


def test_chat_template_lists_tools_in_the_system_turn(tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"}]
    text = render(tokenizer, messages, tools=[WEATHER_TOOL], add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(WEATHER_TOOL, ensure_ascii=False) + "\n</tools>" in text
    assert (
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
        in text
    )
    assert text.count("<|im_start|>system") == 1
    assert text.endswith("<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n")


def test_chat_template_renders_tool_calls_and_folds_tool_results(tokenizer) -> None:
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    raw_call = {
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
    }
    messages = [
        {"role": "user", "content": "Oslo and Rome?"},
        {"role": "assistant", "content": "", "tool_calls": [call, raw_call]},
        {"role": "tool", "content": "4 C"},
        {"role": "tool", "content": "21 C"},
    ]
    text = render(tokenizer, messages, tools=[WEATHER_TOOL], add_generation_prompt=True)
    assert text.endswith(
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
        "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n4 C\n</tool_response>\n"
        "<tool_response>\n21 C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_chat_template_keeps_reasoning_only_after_the_last_query(tokenizer) -> None:
    messages = [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "reasoning_content": "old thought", "content": "A1"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "reasoning_content": "new thought", "content": "A2"},
    ]
    text = render(tokenizer, messages)
    assert "old thought" not in text
    assert "<|im_start|>assistant\nA1<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n<think>\nnew thought\n</think>\n\nA2<|im_end|>\n")


def test_greedy_continuations_are_varied_and_run_the_full_length(model, tokenizer) -> None:
    eos_ids = {tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}
    continuations = []
    for prompt in TEST_PROMPTS:
        input_ids = tokenizer(prompt, return_tensors="pt").input_ids
        output = model.generate(input_ids, do_sample=False, max_new_tokens=24)
        new_tokens = output[0, input_ids.shape[1] :].tolist()
        assert len(new_tokens) == 24 and not eos_ids & set(new_tokens), prompt
        assert len(set(new_tokens)) >= 8, (prompt, tokenizer.decode(new_tokens))
        continuations.append(tuple(new_tokens))
    assert len(TEST_PROMPTS) >= 8
    assert len(set(continuations)) == len(continuations)


def test_build_is_byte_identical_across_runs(tmp_path: Path) -> None:
    # A few steps and no top-up rounds keep it fast; the full build is checked by the long test.
    first = build_tiny_model(tmp_path / "a", train_steps=3, max_topups=0)
    second = build_tiny_model(tmp_path / "b", train_steps=3, max_topups=0)
    for name in sorted(p.name for p in first.iterdir()):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name


@pytest.mark.long
def test_full_build_reproduces_the_cached_model(tiny_model_path: Path, tmp_path: Path) -> None:
    rebuilt = build_tiny_model(tmp_path / "model")
    cached = (tiny_model_path / "model.safetensors").read_bytes()
    assert (rebuilt / "model.safetensors").read_bytes() == cached


def test_ensure_builtin_returns_the_cache_without_rebuilding(tiny_model_path: Path) -> None:
    weights = tiny_model_path / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    assert ensure_builtin("builtin:tiny") == tiny_model_path
    assert weights.stat().st_mtime_ns == mtime
