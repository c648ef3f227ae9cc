"""A harmony tokenizer for the tiny gpt-oss checkpoint and the tests, and texts to train it on.

The tokenizer is the tiny model's byte-level BPE (tools/tiny_model/tokenizer.py: 4,070 Qwen
ranks and Qwen3's 26 added tokens) plus gpt-oss's special tokens, each one id, so the harmony
structure costs what it costs gpt-oss (a marker is one token, never its characters):

    0 .. 4069       Qwen ranks                 4096  <|startoftext|>    4100  <|start|>
    4070            <|endoftext|> (shared)     4097  <|return|>         4101  <|end|>
    4071 .. 4095    Qwen3's other markers      4098  <|constrain|>      4102  <|message|>
                                               4099  <|channel|>        4103  <|call|>

The embedding has VOCAB_SIZE rows (4,104 rounded up to a multiple of 64). Generation stops at
EOS_TOKEN_IDS, as gpt-oss's generation_config.json lists them: <|return|>, <|endoftext|>,
<|call|>. `harmony_training_texts` writes conversations with common/harmony.py (the frontend's
renderer) followed by the answers a harmony model gives, for the tiny model to learn the format.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer

from common import harmony
from common.harmony import SystemSettings
from tools.tiny_model.tokenizer import NUM_KEPT_RANKS, added_tokens_decoder, build_tokenizer

# gpt-oss's special tokens in its own id order (o200k_harmony: 199998, 199999, 200002, ...)
HARMONY_TOKENS = (
    "<|startoftext|>",
    "<|endoftext|>",
    "<|return|>",
    "<|constrain|>",
    "<|channel|>",
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|call|>",
)
ENDOFTEXT_ID = NUM_KEPT_RANKS  # the tiny tokenizer has it already
STARTOFTEXT_ID = 4096
RETURN_ID = 4097
CONSTRAIN_ID = 4098
CHANNEL_ID = 4099
START_ID = 4100
END_ID = 4101
MESSAGE_ID = 4102
CALL_ID = 4103
NUM_IDS = 4104
VOCAB_SIZE = -(-NUM_IDS // 64) * 64  # 4160: the embedding's rows
EOS_TOKEN_IDS = (RETURN_ID, ENDOFTEXT_ID, CALL_ID)  # gpt-oss's generation_config order
TOKEN_IDS = {
    "<|startoftext|>": STARTOFTEXT_ID,
    "<|endoftext|>": ENDOFTEXT_ID,
    "<|return|>": RETURN_ID,
    "<|constrain|>": CONSTRAIN_ID,
    "<|channel|>": CHANNEL_ID,
    "<|start|>": START_ID,
    "<|end|>": END_ID,
    "<|message|>": MESSAGE_ID,
    "<|call|>": CALL_ID,
}


def build_harmony_tokenizer() -> Tokenizer:
    tokenizer = build_tokenizer()
    for content in HARMONY_TOKENS:  # one at a time: ids follow call order
        tokenizer.add_tokens([AddedToken(content, special=True, normalized=False)])
    ids = {content: tokenizer.token_to_id(content) for content in HARMONY_TOKENS}
    if ids != TOKEN_IDS or tokenizer.get_vocab_size() != NUM_IDS:
        raise AssertionError(f"harmony tokens got ids {ids}, not {TOKEN_IDS}")
    return tokenizer


def _added_token(content: str) -> dict[str, object]:
    return {"content": content, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True}  # fmt: skip


def tokenizer_config(model_max_length: int) -> dict[str, object]:
    """tokenizer_config.json as gpt-oss's (a fast tokenizer; <|return|> ends a turn). No chat
    template: the frontend renders harmony itself (common/harmony.py)."""
    decoder = added_tokens_decoder()
    decoder.update({str(TOKEN_IDS[c]): _added_token(c) for c in HARMONY_TOKENS})
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": dict(sorted(decoder.items(), key=lambda kv: int(kv[0]))),
        "bos_token": "<|startoftext|>",
        "eos_token": "<|return|>",
        "pad_token": "<|endoftext|>",
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": model_max_length,
    }


def write_harmony_tokenizer(path: Path, model_max_length: int = 4096) -> None:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json into `path`."""
    path.mkdir(parents=True, exist_ok=True)
    build_harmony_tokenizer().save(str(path / "tokenizer.json"))
    special = {"bos_token": "<|startoftext|>", "eos_token": "<|return|>",
               "pad_token": "<|endoftext|>"}  # fmt: skip
    for name, payload in [
        ("tokenizer_config.json", tokenizer_config(model_max_length)),
        ("special_tokens_map.json", special),
    ]:
        text = json.dumps(payload, indent=2, ensure_ascii=False) + "\n"
        (path / name).write_text(text, encoding="utf-8")


# --- training texts -------------------------------------------------------------------------------

SEED = 20250805
NUM_TEXTS = 360
CITIES = ["Paris", "Tokyo", "Berlin", "Rome", "Madrid", "Cairo", "Lima", "Oslo", "Seoul", "Boston"]
CAPITALS = {"France": "Paris", "Japan": "Tokyo", "Germany": "Berlin", "Italy": "Rome",
            "Spain": "Madrid", "Egypt": "Cairo", "Peru": "Lima", "Norway": "Oslo"}  # fmt: skip
CONDITIONS = ["sunny", "cloudy", "rainy", "windy", "snowy"]
TOPICS = ["green tea", "old maps", "river boats", "jazz music", "solar power", "city parks"]
INSTRUCTIONS = ["Answer briefly.", "You are a helpful assistant.", "Be kind and clear.",
                "Reply in one sentence."]  # fmt: skip


def _string(description: str) -> dict[str, Any]:
    return {"type": "string", "description": description}


TOOLS: dict[str, dict[str, Any]] = {
    "get_weather": {
        "name": "get_weather",
        "description": "Gets the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "location": _string("The city, e.g. Paris"),
                "unit": {
                    "type": "string",
                    "enum": ["celsius", "fahrenheit"],
                    "default": "celsius",
                },  # fmt: skip
            },
            "required": ["location"],
        },
    },
    "get_time": {
        "name": "get_time",
        "description": "Gets the local time in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": _string("The city")},
            "required": ["city"],
        },  # fmt: skip
    },
    "add": {
        "name": "add",
        "description": "Adds two numbers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
            "required": ["a", "b"],
        },  # fmt: skip
    },
    "search": {
        "name": "search",
        "description": "Searches the web.",
        "parameters": {
            "type": "object",
            "properties": {"query": _string("What to look for")},
            "required": ["query"],
        },  # fmt: skip
    },
}


def _plain_turn(rng: random.Random) -> tuple[str, str, str]:
    """(question, analysis, answer) that needs no tool."""
    kind = rng.randrange(3)
    if kind == 0:
        a, b = rng.randrange(1, 50), rng.randrange(1, 50)
        return (f"What is {a} + {b}?", f"User asks for {a} + {b}. Simple sum: {a + b}.",
                f"{a} + {b} = {a + b}.")  # fmt: skip
    if kind == 1:
        country = rng.choice(list(CAPITALS))
        capital = CAPITALS[country]
        return (f"What is the capital of {country}?",
                f"User asks about {country}. The capital is {capital}.",
                f"The capital of {country} is {capital}.")  # fmt: skip
    name = rng.choice(["Ana", "Bo", "Kim", "Sam", "Lee"])
    return (f"Hi, I am {name}.", "User says hello. Greet back.", f"Hello {name}! How can I help?")


def _tool_turn(rng: random.Random) -> tuple[str, str, dict[str, Any], Any, str]:
    """(question, tool name, arguments, the tool's result, the answer from it)."""
    kind = rng.choice(list(TOOLS))
    if kind == "get_weather":
        city, condition, degrees = rng.choice(CITIES), rng.choice(CONDITIONS), rng.randrange(30)
        result = {"temperature": degrees, "condition": condition}
        return (f"What is the weather in {city}?", kind, {"location": city}, result,
                f"It is {condition} and {degrees} degrees in {city}.")  # fmt: skip
    if kind == "get_time":
        city, hour, minute = rng.choice(CITIES), rng.randrange(24), rng.randrange(60)
        clock = f"{hour:02d}:{minute:02d}"
        return (f"What time is it in {city}?", kind, {"city": city}, {"time": clock},
                f"It is {clock} in {city}.")  # fmt: skip
    if kind == "add":
        a, b = rng.randrange(100, 999), rng.randrange(100, 999)
        return (f"Use the tool to add {a} and {b}.", kind, {"a": a, "b": b}, {"sum": a + b},
                f"{a} + {b} = {a + b}.")  # fmt: skip
    topic = rng.choice(TOPICS)
    title = f"A short guide to {topic}"
    return (f"Search the web for {topic}.", kind, {"query": topic}, {"results": [title]},
            f"I found: {title}.")  # fmt: skip


def _analysis(text: str) -> str:
    """The answer's first message: the output starts after the prompt's `<|start|>assistant`."""
    return f"{harmony.CHANNEL}analysis{harmony.MESSAGE}{text}{harmony.END}"


def _final(analysis: str, answer: str) -> str:
    final = harmony.message(f"assistant{harmony.CHANNEL}final", answer, harmony.RETURN)
    return _analysis(analysis) + final


def _call(analysis: str, name: str, arguments: str) -> str:
    return _analysis(analysis) + harmony.call_message(name, arguments)


def _conversation(rng: random.Random) -> str:
    """One prompt (with its history) and the answer: analysis then final without tools;
    analysis then a call with tools; analysis then final after the tool's result."""
    settings = SystemSettings(
        date=f"2025-{rng.randrange(1, 13):02d}-{rng.randrange(1, 29):02d}",
        effort=rng.choice(["low", "medium", "high"]),
    )
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.4:
        messages.append({"role": "system", "content": rng.choice(INSTRUCTIONS)})
    for _ in range(rng.choice([0, 0, 1, 2])):  # earlier turns: their answers, no reasoning
        question, _, answer = _plain_turn(rng)
        messages += [{"role": "user", "content": question},
                     {"role": "assistant", "content": answer}]  # fmt: skip
    mode = rng.choices(["plain", "call", "result"], weights=[4, 4, 3])[0]
    if mode == "plain":
        question, analysis, answer = _plain_turn(rng)
        messages.append({"role": "user", "content": question})
        prompt = harmony.render(messages, [], settings)
        return prompt + _final(analysis, answer)
    question, name, arguments, result, answer = _tool_turn(rng)
    others = rng.sample([t for t in TOOLS if t != name], rng.randrange(3))
    functions = [TOOLS[t] for t in rng.sample([name, *others], len(others) + 1)]
    arguments_text = json.dumps(arguments, separators=(",", ":"))
    messages.append({"role": "user", "content": question})
    need = f"User asks: {question} Need to call {name}."
    if mode == "call":
        return harmony.render(messages, functions, settings) + _call(need, name, arguments_text)
    call = {"id": "call_0", "type": "function",
            "function": {"name": name, "arguments": arguments_text}}  # fmt: skip
    messages += [
        {"role": "assistant", "content": None, "reasoning_content": need, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": json.dumps(result)},
    ]
    analysis = f"The {name} tool answered. Reply to the user."
    return harmony.render(messages, functions, settings) + _final(analysis, answer)


def harmony_training_texts(num_texts: int = NUM_TEXTS, seed: int = SEED) -> list[str]:
    """Rendered conversations, each followed by a well-formed harmony answer (the same texts
    for the same seed)."""
    rng = random.Random(seed)
    return [_conversation(rng) for _ in range(num_texts)]
