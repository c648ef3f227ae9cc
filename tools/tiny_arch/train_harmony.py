"""A short training run that teaches the tiny gpt-oss checkpoint harmony's answer structure.

With random weights a model never writes `<|channel|>final<|message|>...<|return|>`, so the chat
tests (reasoning, content, a tool call round trip through the harmony parser) would have nothing
to parse. tools/tiny_arch/harmony.py writes conversations rendered by the frontend's own renderer,
each followed by a well-formed answer; the model is trained on the answers only (the loss masks
the prompt), so it learns to start with an analysis message and end with a final answer or a
call. Each example keeps the last PROMPT_TOKENS of its prompt: what decides the answer (the end of
the tool declarations, a tool's result, the question) lies there, and whole prompts (~300 tokens
of system and developer messages) made a step four times as long. About 40 s on one thread;
38 of 40 held-out conversations answered well-formed, the misses calling a tool again after its
result (the chat tests make that turn's tool_choice "none").
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tokenizers import Tokenizer

from common import harmony as harmony_format
from common.model_cache import progress
from tools.tiny_arch import harmony

if TYPE_CHECKING:
    from transformers import PreTrainedModel

STEPS = 400
BATCH_SIZE = 8
PEAK_LR = 3e-3
PROMPT_TOKENS = 48
CHECK_CONVERSATIONS = 40  # held out (another seed): how many must answer well-formed ...
CHECK_MIN_WELLFORMED = 32  # ... at least
ANSWER_START = f"{harmony_format.START}assistant{harmony_format.CHANNEL}analysis"


def answer_examples(model_dir: Path) -> list[tuple[list[int], int]]:
    """Each training text as (token ids, index of the answer's first token)."""
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    examples = []
    for text in harmony.harmony_training_texts():
        split = text.rfind(ANSWER_START) + len(f"{harmony_format.START}assistant")
        prompt = tokenizer.encode(text[:split], add_special_tokens=False).ids[-PROMPT_TOKENS:]
        answer = tokenizer.encode(text[split:], add_special_tokens=False).ids
        examples.append((prompt + answer, len(prompt)))
    return examples


def _batch(examples: list[tuple[list[int], int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), harmony.ENDOFTEXT_ID)
    labels = torch.full((len(examples), width), -100)
    for row, (tokens, start) in enumerate(examples):
        ids[row, : len(tokens)] = torch.tensor(tokens)
        labels[row, start : len(tokens)] = torch.tensor(tokens[start:])
    return ids, labels


def train_on_harmony(model: PreTrainedModel, model_dir: Path, steps: int = STEPS) -> float:
    """AdamW with a cosine decay on random batches of the answers; returns the last loss."""
    examples = answer_examples(model_dir)
    generator = torch.Generator().manual_seed(len(examples))
    optimizer = torch.optim.AdamW(model.parameters(), lr=PEAK_LR, betas=(0.9, 0.95))
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps, eta_min=PEAK_LR / 10)
    model.train()
    start, loss_value = time.perf_counter(), float("nan")
    for step in range(1, steps + 1):
        picks = torch.randint(0, len(examples), (BATCH_SIZE,), generator=generator).tolist()
        ids, labels = _batch([examples[i] for i in picks])
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = loss.item()
        if step % 100 == 0 or step == steps:
            progress(f"tiny-gpt-oss: harmony step {step}/{steps}, loss {loss_value:.2f}, "
                     f"{time.perf_counter() - start:.0f} s")  # fmt: skip
    model.eval()
    return loss_value


def wellformed_answers(model: PreTrainedModel, model_dir: Path) -> int:
    """How many of CHECK_CONVERSATIONS held-out prompts get a greedy answer of the expected
    shape: analysis, then a final answer ending in <|return|>, or a call ending in <|call|>."""
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    count = 0
    for text in harmony.harmony_training_texts(CHECK_CONVERSATIONS, seed=harmony.SEED + 1):
        split = text.rfind(ANSWER_START) + len(f"{harmony_format.START}assistant")
        prompt = tokenizer.encode(text[:split], add_special_tokens=False).ids
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=96,
                                 eos_token_id=list(harmony.EOS_TOKEN_IDS),
                                 pad_token_id=harmony.ENDOFTEXT_ID)  # fmt: skip
        answer = tokenizer.decode(out[0, len(prompt) :].tolist(), skip_special_tokens=False)
        if not answer.startswith(f"{harmony_format.CHANNEL}analysis{harmony_format.MESSAGE}"):
            continue
        if harmony_format.CALL in text[split:]:
            count += answer.endswith(harmony_format.CALL) and " to=functions." in answer
        else:
            final = f"{harmony_format.CHANNEL}final{harmony_format.MESSAGE}"
            count += final in answer and answer.endswith(harmony_format.RETURN)
    return count
