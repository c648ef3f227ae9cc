"""The deterministic tiny Qwen3 model behind `model: builtin:tiny`, built offline in under a minute.

Tests and local runs need a real Hugging Face checkpoint (config.json, safetensors, tokenizer.json,
a chat template) that transformers loads, without a model hub. This module writes one: a 4-layer
Qwen3 with GQA over a real Qwen byte-level BPE cut to 4,096 ids (tokenizer.py beside it), briefly
trained on the text in data/ so that greedy continuations vary instead of repeating a token.

    python -m tools.tiny_model PATH                   # build into PATH
    python -m engine.builtin_build builtin:tiny       # build once into the cache (or reuse it)

Same machine, same library versions -> byte-identical model.safetensors: the seed, the data order
and the thread count are fixed. One thread: two OpenMP threads were 20% faster on an idle host but
many times slower on a busy one (they spin on each other). Bump the version in TINY.directory
(common/builtin_models.py) whenever the output changes, so that caches are rebuilt.
"""

import argparse
import json
import math
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer

from common.model_cache import progress
from tools.tiny_model.tokenizer import (
    ADDED_TOKENS,
    NUM_KEPT_RANKS,
    added_tokens_decoder,
    build_tokenizer,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

VOCAB_SIZE = NUM_KEPT_RANKS + len(ADDED_TOKENS)  # 4096: already a multiple of 64
ENDOFTEXT_ID = NUM_KEPT_RANKS  # <|endoftext|>: pad token
IM_END_ID = NUM_KEPT_RANKS + 2  # <|im_end|>: end of an assistant turn
# The special markers besides <|endoftext|>, listed as in Qwen3's tokenizer_config.json.
ADDITIONAL_SPECIAL_TOKENS = [content for content, special in ADDED_TOKENS[1:] if special]

SEED = 20240601
BUILD_THREADS = 1
TRAIN_STEPS = 200
PROGRESS_EVERY_STEPS = 50
BATCH_SIZE = 4
SEQ_LEN = 128
PEAK_LR = 3e-3
INIT_STD = 0.02
EMBED_INIT_STD = 1.0
EMBED_LR_MULT = 10.0  # unit-scale embeddings need larger steps to move as fast, relatively
# The build's own check of TEST_PROMPTS (see build_tiny_model), with the tests' thresholds.
CHECK_NEW_TOKENS = 24
CHECK_MIN_DISTINCT = 8
MAX_TOPUPS = 6
TOPUP_STEPS = 20
TOPUP_LR = 1e-3

# Every added token but <|im_end|> is input only in training (see training_tokens).
INPUT_ONLY_IDS = frozenset(range(NUM_KEPT_RANKS, VOCAB_SIZE)) - {IM_END_ID}
# An assistant turn's content and its closing marker, as the chat template renders them.
ASSISTANT_TURN = re.compile(r"(?<=<\|im_start\|>assistant\n).*?<\|im_end\|>", re.DOTALL)

# Plain-text prompts whose 24-token greedy continuations are varied and EOS-free on the built model
# (checked by the build itself and by tests/unit/tools/test_tiny_model.py); parity tests elsewhere
# reuse them. Picked from 36 candidates as the ones that did best across several training seeds.
TEST_PROMPTS: list[str] = [
    "Rivers shape the land",
    "Every evening the lamp",
    "import numpy as np\n",
    "Python is a programming language that",
    "def count_words(text: str) -> dict[str, int]:",
    "A tokenizer turns text into",
    "Meeting notes, Tuesday.",
    "Prefix caching saves work when",
    "Once upon a time",
    "The weather today is",
]


def model_config() -> dict[str, object]:
    """config.json in the layout of Qwen3 checkpoints on the Hub (transformers 5 reads it)."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 4,
        "tie_word_embeddings": False,
        "initializer_range": INIT_STD,
        "bos_token_id": ENDOFTEXT_ID,
        "eos_token_id": IM_END_ID,
        "pad_token_id": ENDOFTEXT_ID,
        "use_cache": True,
        "torch_dtype": "float32",
    }


def generation_config() -> dict[str, object]:
    """Stop on either end marker, like Qwen3; no sampling defaults, so generate() is greedy."""
    return {
        "bos_token_id": ENDOFTEXT_ID,
        "eos_token_id": [IM_END_ID, ENDOFTEXT_ID],
        "pad_token_id": ENDOFTEXT_ID,
    }


def tokenizer_config(chat_template: str) -> dict[str, object]:
    """tokenizer_config.json for a Qwen2Tokenizer with Qwen3's markers and our chat template."""
    return {
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": added_tokens_decoder(),
        "additional_special_tokens": ADDITIONAL_SPECIAL_TOKENS,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": 4096,
        "split_special_tokens": False,
        "chat_template": chat_template,
    }


def _data_text(name: str) -> str:
    return resources.files("tools.tiny_model").joinpath("data", name).read_text("utf-8")


def load_corpus() -> str:
    """data/corpus.txt without its comment header (the leading "#" lines)."""
    lines = _data_text("corpus.txt").splitlines(keepends=True)
    while lines and lines[0].startswith("#"):
        lines.pop(0)
    return "".join(lines).strip() + "\n"


def write_json(path: Path, payload: object) -> None:
    path.write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_tokenizer_files(path: Path) -> None:
    build_tokenizer().save(str(path / "tokenizer.json"))
    write_json(path / "tokenizer_config.json", tokenizer_config(_data_text("chat_template.jinja")))
    special_tokens = {
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "additional_special_tokens": ADDITIONAL_SPECIAL_TOKENS,
    }
    write_json(path / "special_tokens_map.json", special_tokens)


def training_tokens(model_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ids and labels: the corpus, then the chat samples rendered by the model's own template.

    In the chats only the assistant's words and its closing <|im_end|> are targets (label -100
    elsewhere): the model reads every marker but never learns to emit one other than <|im_end|>.
    When it did, plain-text continuations drifted into "<|im_start|>assistant" or "<think>" loops.
    """
    from transformers import AutoTokenizer

    chat_tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pieces: list[tuple[str, bool]] = [(load_corpus() + "\n", True)]  # (text, is_target)
    for sample in json.loads(_data_text("chat_samples.json")):
        chat = chat_tokenizer.apply_chat_template(
            sample["messages"], tools=sample.get("tools"), tokenize=False
        )
        position = 0
        for turn in ASSISTANT_TURN.finditer(chat):
            pieces += [(chat[position : turn.start()], False), (turn.group(), True)]
            position = turn.end()
        pieces.append((chat[position:], False))

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids: list[int] = []
    labels: list[int] = []
    for text, is_target in pieces:
        piece = tokenizer.encode(text).ids
        ids += piece
        labels += [i if is_target and i not in INPUT_ONLY_IDS else -100 for i in piece]
    return torch.tensor(ids), torch.tensor(labels)


@contextmanager
def fixed_threads(num_threads: int) -> Iterator[None]:
    """Float reductions depend on how work is split across threads; fix the split for the build."""
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def init_weights(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Our own init, so the bytes do not depend on transformers' init code.

    Unit-scale embeddings (the first RMSNorm makes the scale harmless) dominate the small random
    residual branches at the start, so the model learns "next token given this token" within a few
    dozen steps; at the usual std 0.02 it sat on a unigram plateau for most of the step budget.
    """
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith("embed_tokens.weight"):
                param.normal_(0.0, EMBED_INIT_STD, generator=generator)
            else:
                param.normal_(0.0, INIT_STD, generator=generator)


def learning_rate(step: int, num_steps: int) -> float:
    """Short linear warmup, then cosine decay to a tenth of the peak."""
    warmup = max(1, num_steps // 10)
    if step < warmup:
        return PEAK_LR * (step + 1) / warmup
    progress = (step - warmup) / max(1, num_steps - warmup)
    return PEAK_LR * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def make_optimizer(model: torch.nn.Module) -> torch.optim.AdamW:
    params = dict(model.named_parameters())
    embed = [p for name, p in params.items() if name.endswith("embed_tokens.weight")]
    rest = [p for name, p in params.items() if not name.endswith("embed_tokens.weight")]
    groups = [{"params": embed, "lr_mult": EMBED_LR_MULT}, {"params": rest, "lr_mult": 1.0}]
    return torch.optim.AdamW(groups, lr=PEAK_LR, betas=(0.9, 0.95), weight_decay=0.0)


def train(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    tokens: tuple[torch.Tensor, torch.Tensor],
    learning_rates: list[float],
    generator: torch.Generator,
) -> float:
    """One AdamW step per learning rate on random windows of (ids, labels); returns last loss."""
    ids, labels = tokens
    model.train()
    last_loss = float("nan")
    start = time.perf_counter()
    for step, lr in enumerate(learning_rates, 1):
        starts = torch.randint(0, len(ids) - SEQ_LEN, (BATCH_SIZE,), generator=generator).tolist()
        batch = torch.stack([ids[s : s + SEQ_LEN] for s in starts])  # (batch, seq_len)
        targets = torch.stack([labels[s : s + SEQ_LEN] for s in starts])  # (batch, seq_len)
        for group in optimizer.param_groups:
            group["lr"] = lr * group["lr_mult"]
        loss = model(input_ids=batch, labels=targets).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        last_loss = loss.item()
        if step % PROGRESS_EVERY_STEPS == 0 or step == len(learning_rates):
            progress(
                f"tiny model: step {step}/{len(learning_rates)}, loss {last_loss:.2f}, "
                f"{time.perf_counter() - start:.0f} s"
            )
    model.eval()
    return last_loss


def degenerate_prompts(model: "PreTrainedModel", tokenizer: "PreTrainedTokenizerBase") -> list[str]:
    """TEST_PROMPTS whose greedy continuation ends early or has too few distinct tokens."""
    stop_ids = generation_config()["eos_token_id"]
    degenerate = []
    for prompt in TEST_PROMPTS:
        inputs = tokenizer(prompt, return_tensors="pt")
        output = model.generate(
            **inputs,
            do_sample=False,
            max_new_tokens=CHECK_NEW_TOKENS,
            eos_token_id=stop_ids,
            pad_token_id=ENDOFTEXT_ID,
        )
        new_tokens = output[0, inputs["input_ids"].shape[1] :].tolist()
        if len(new_tokens) < CHECK_NEW_TOKENS or len(set(new_tokens)) < CHECK_MIN_DISTINCT:
            degenerate.append(prompt)
    return degenerate


def build_tiny_model(
    path: Path,
    *,
    train_steps: int = TRAIN_STEPS,
    max_topups: int = MAX_TOPUPS,
    dtype: str = "float32",
) -> Path:
    """Write the complete model directory to `path` (created if missing) and return it.

    Float rounding differs between CPUs, so another machine trains a slightly different model, and
    on it a test prompt may fall into a greedy loop. The build checks TEST_PROMPTS itself and trains
    up to `max_topups` short extra rounds until none is degenerate, so the contract the tests rely
    on holds wherever the model is built (and the result stays deterministic per machine).
    The model is float32 whatever `dtype` the cluster runs: the engine casts it at load.
    """
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    progress(f"tiny model: tokenizer and config ({VOCAB_SIZE} ids)")
    write_tokenizer_files(path)
    write_json(path / "config.json", model_config())
    write_json(path / "generation_config.json", generation_config())

    with fixed_threads(BUILD_THREADS), torch.random.fork_rng(devices=[]):
        generator = torch.Generator().manual_seed(SEED)
        model = Qwen3ForCausalLM(Qwen3Config.from_pretrained(path)).to(torch.float32)
        init_weights(model, generator)
        optimizer = make_optimizer(model)
        tokens = training_tokens(path)
        schedule = [learning_rate(step, train_steps) for step in range(train_steps)]
        progress(f"tiny model: training {train_steps} steps on {len(tokens[0])} tokens, 1 thread")
        train(model, optimizer, tokens, schedule, generator)
        tokenizer = AutoTokenizer.from_pretrained(path)
        for _ in range(max_topups):
            progress(f"tiny model: checking the {len(TEST_PROMPTS)} test prompts' continuations")
            degenerate = degenerate_prompts(model, tokenizer)
            if not degenerate:
                break
            progress(f"tiny model: {len(degenerate)} loop; training {TOPUP_STEPS} more steps")
            train(model, optimizer, tokens, [TOPUP_LR] * TOPUP_STEPS, generator)

    progress("tiny model: writing model.safetensors")
    tensors = {name: tensor.detach().contiguous() for name, tensor in model.state_dict().items()}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build the deterministic tiny Qwen3 test model.")
    parser.add_argument("path", type=Path, help="output directory")
    parser.add_argument("--train-steps", type=int, default=TRAIN_STEPS)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    path = build_tiny_model(args.path, train_steps=args.train_steps)
    print(f"tiny model ready in {path} ({time.perf_counter() - start:.1f}s)")


if __name__ == "__main__":
    main()
