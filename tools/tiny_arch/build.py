"""Small checkpoints of each architecture the engine serves, for greedy parity tests against
transformers: the architecture's real config (its transformers config class, with the values of
the checkpoint named below) scaled down to a few layers and a 64-wide hidden state, random
weights, the tiny model's tokenizer (tools/tiny_model/) or, for gpt-oss, its harmony variant.

    orchestrator build-model builtin:tiny-gemma2        # or python -m engine.builtin_build ...

Scaled down, not changed: what makes an architecture itself stays (Gemma 2's soft caps and its
alternating windows, Gemma 3's five local layers per global one and their two rotary bases,
Phi-4-mini's partial rotary and LongRoPE, Qwen3-MoE's normalised top-k, gpt-oss's sinks, YaRN and
clamped SwiGLU). Sliding windows are shrunk to 16 tokens and Phi's pretraining length to 64, so
that test prompts of a few dozen tokens cross them.

Random weights at the usual std 0.02 give one token repeated; here each matrix has std
fan_in ** -0.5 (activations keep their scale through the layers), embeddings std 1 (Gemma's,
which it multiplies by sqrt(hidden), 1 / sqrt(hidden)), norms near one, and the build checks
that greedy continuations of the tiny model's TEST_PROMPTS vary, trying the next seed if not.
With tied embeddings (Gemma, Phi-4-mini) random weights echo the current token (the last hidden
state still looks most like its own embedding), so those are trained for TRAIN_STEPS on the tiny
model's corpus first (~25 s); gpt-oss is trained on harmony conversations
(tools/tiny_arch/train_harmony.py) so that it answers in harmony's channels for the chat tests.
Same machine, same library versions -> the same bytes.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from common.model_cache import progress
from tools.tiny_model.build import (
    CHECK_MIN_DISTINCT,
    CHECK_NEW_TOKENS,
    ENDOFTEXT_ID,
    IM_END_ID,
    TEST_PROMPTS,
    VOCAB_SIZE,
    fixed_threads,
    learning_rate,
    make_optimizer,
    train,
    training_tokens,
    write_tokenizer_files,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

SEED = 20261205
MAX_SEEDS = 8
TRAIN_STEPS = 300  # tied embeddings: on the tiny model's corpus (module docstring)
# The scaled-down sizes every architecture shares (each may override).
SMALL: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": VOCAB_SIZE,
    "bos_token_id": ENDOFTEXT_ID,
    "eos_token_id": IM_END_ID,
    "pad_token_id": ENDOFTEXT_ID,
    "tie_word_embeddings": False,
}
WINDOW = 16


def _mistral() -> PretrainedConfig:
    """Mistral-7B-v0.1: a sliding window on every layer, rope theta 10,000."""
    from transformers import MistralConfig

    return MistralConfig(**SMALL, sliding_window=WINDOW, rope_theta=10000.0,
                         max_position_embeddings=32768)  # fmt: skip


def _gemma2() -> PretrainedConfig:
    """gemma-2-27b: soft caps 50 (scores) and 30 (logits), sliding window on every other layer,
    query_pre_attn_scalar unequal to head_dim (144 for 128 there, 18 for 16 here), tied."""
    from transformers import Gemma2Config

    return Gemma2Config(**{**SMALL, "tie_word_embeddings": True}, query_pre_attn_scalar=18,
                        sliding_window=WINDOW, attn_logit_softcapping=50.0,
                        final_logit_softcapping=30.0, max_position_embeddings=8192)  # fmt: skip


def _gemma3() -> PretrainedConfig:
    """gemma-3-1b-it (model_type gemma3_text): one KV head, q/k norms, five sliding layers per
    global one (six layers here), rope theta 1,000,000 global and 10,000 local, tied."""
    from transformers import Gemma3TextConfig

    sizes = {**SMALL, "num_hidden_layers": 6, "num_key_value_heads": 1,
             "tie_word_embeddings": True}  # fmt: skip
    rope = {"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}  # fmt: skip
    return Gemma3TextConfig(**sizes, query_pre_attn_scalar=16, sliding_window=WINDOW,
                            sliding_window_pattern=6, rope_parameters=rope,
                            max_position_embeddings=32768)  # fmt: skip


def _phi3() -> PretrainedConfig:
    """Phi-4-mini-instruct (model_type phi3): three quarters of each head rotate, LongRoPE with
    its short and long factors past the pretraining length (4,096 there, 64 here), tied."""
    from transformers import Phi3Config

    sizes = {k: v for k, v in SMALL.items() if k != "head_dim"}
    rotary_dim = 12  # 0.75 of 16
    short = [1.0 + 0.05 * i for i in range(rotary_dim // 2)]
    long = [1.0 + 0.9 * i for i in range(rotary_dim // 2)]
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": short,
            "long_factor": long, "original_max_position_embeddings": 64,
            "partial_rotary_factor": 0.75}  # fmt: skip
    return Phi3Config(**{**sizes, "tie_word_embeddings": True}, rope_parameters=rope,
                      partial_rotary_factor=0.75, original_max_position_embeddings=64,
                      max_position_embeddings=512)  # fmt: skip


def _qwen3_moe() -> PretrainedConfig:
    """Qwen3-30B-A3B: q/k norms, 128 experts top 8 normalised (16 top 4 here), every layer
    sparse."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**SMALL, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32,
                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                          max_position_embeddings=40960, rope_theta=1_000_000.0)  # fmt: skip


def _mixtral() -> PretrainedConfig:
    """Mixtral-8x7B: 8 experts, top 2, renormalised, no window, rope theta 1,000,000."""
    from transformers import MixtralConfig

    return MixtralConfig(**{**SMALL, "intermediate_size": 96}, num_local_experts=8,
                         num_experts_per_tok=2, rope_theta=1_000_000.0,
                         max_position_embeddings=32768)  # fmt: skip


def _gpt_oss() -> PretrainedConfig:
    """gpt-oss-20b: q/k/v/o biases, sinks, sliding (128 there) and full layers alternating, YaRN
    (factor 32 over 4,096), 32 experts top 4 (8 here) with biases and clamped SwiGLU."""
    from transformers import GptOssConfig

    from tools.tiny_arch import harmony

    sizes = {**SMALL, "intermediate_size": 64, "vocab_size": harmony.VOCAB_SIZE,
             "bos_token_id": harmony.STARTOFTEXT_ID, "eos_token_id": list(harmony.EOS_TOKEN_IDS),
             "pad_token_id": harmony.ENDOFTEXT_ID}  # fmt: skip
    return GptOssConfig(**sizes, num_local_experts=8, num_experts_per_tok=4, sliding_window=WINDOW)


CONFIGS = {
    "mistral": _mistral,
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "phi3": _phi3,
    "qwen3-moe": _qwen3_moe,
    "mixtral": _mixtral,
    "gpt-oss": _gpt_oss,
}


def init_random(model: torch.nn.Module, generator: torch.Generator, gemma: bool) -> None:
    """Weights whose greedy continuations vary (module docstring), in name order, so the bytes
    depend on the seed alone."""
    text_config = model.config.get_text_config()  # a LLaVA's: its language model's
    hidden = text_config.hidden_size
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "norm" in name:  # Gemma stores the scale as w - 1
                param.normal_(0.0 if gemma else 1.0, 0.1, generator=generator)
            elif name.endswith("embed_tokens.weight"):  # Gemma multiplies it by sqrt(hidden)
                param.normal_(0.0, hidden**-0.5 if gemma else 1.0, generator=generator)
            elif name.endswith("sinks"):
                param.normal_(0.0, 1.0, generator=generator)
            elif param.dim() == 1:  # biases
                param.normal_(0.0, 0.1, generator=generator)
            elif param.dim() == 3:  # stacked experts: the down projection reads inter
                inter = text_config.intermediate_size
                fan_in = inter if "down" in name else hidden
                param.normal_(0.0, fan_in**-0.5, generator=generator)
            else:
                param.normal_(0.0, param.shape[1] ** -0.5, generator=generator)


def _train_on_corpus(model: PreTrainedModel, path: Path, generator: torch.Generator) -> None:
    rates = [learning_rate(step, TRAIN_STEPS) for step in range(TRAIN_STEPS)]
    train(model, make_optimizer(model), training_tokens(path), rates, generator)


def _learns_harmony(model: PreTrainedModel, path: Path) -> bool:
    from tools.tiny_arch import train_harmony

    train_harmony.train_on_harmony(model, path)
    wellformed = train_harmony.wellformed_answers(model, path)
    progress(f"tiny-gpt-oss: {wellformed} of {train_harmony.CHECK_CONVERSATIONS} held-out "
             "conversations answered in well-formed harmony")  # fmt: skip
    return wellformed >= train_harmony.CHECK_MIN_WELLFORMED


def _varied(model: PreTrainedModel, tokenizer: Any, eos_ids: list[int]) -> bool:
    for prompt in TEST_PROMPTS:
        inputs = tokenizer(prompt, return_tensors="pt")
        output = model.generate(**inputs, do_sample=False, max_new_tokens=CHECK_NEW_TOKENS,
                                eos_token_id=eos_ids, pad_token_id=ENDOFTEXT_ID)  # fmt: skip
        new = output[0, inputs["input_ids"].shape[1] :].tolist()
        if len(set(new)) < CHECK_MIN_DISTINCT:
            return False
    return True


def build_tiny_arch(path: Path, *, arch: str, dtype: str = "float32") -> Path:
    """Write builtin:tiny-<arch> into `path` (float32 whatever `dtype`: the engine casts it)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = CONFIGS[arch]()
    if arch == "gpt-oss":
        from tools.tiny_arch import harmony

        harmony.write_harmony_tokenizer(path)
    else:
        write_tokenizer_files(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    with fixed_threads(1):
        for attempt in range(MAX_SEEDS):
            torch.manual_seed(SEED + attempt)
            model = AutoModelForCausalLM.from_config(config).eval()
            generator = torch.Generator().manual_seed(SEED + attempt)
            init_random(model, generator, gemma=arch.startswith("gemma"))
            if arch == "gpt-oss":
                if _learns_harmony(model, path):
                    break
                continue
            if config.tie_word_embeddings:
                _train_on_corpus(model, path, generator)
            if _varied(model, tokenizer, eos):
                break
            progress(f"tiny-{arch}: seed {SEED + attempt} repeats itself; trying the next")
        else:
            raise RuntimeError(f"tiny-{arch}: no seed of {MAX_SEEDS} gave varied continuations")
    return save_tiny(model, path, eos, f"tiny-{arch}")


def save_tiny(model: PreTrainedModel, path: Path, eos: list[int], name: str) -> Path:
    """The checkpoint, greedy by default, the same bytes whichever transformers wrote it."""
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = ENDOFTEXT_ID
    model.generation_config.do_sample = False
    model.save_pretrained(path)
    _drop_transformers_version(path)
    progress(f"{name}: {sum(p.numel() for p in model.parameters()):,} parameters")
    return path


def _drop_transformers_version(path: Path) -> None:
    """The same bytes whichever transformers wrote them: the version stamp is not the model."""
    for name in ("config.json", "generation_config.json"):
        data = json.loads((path / name).read_text())
        data.pop("transformers_version", None)
        (path / name).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


# The builtins' builders (common/builtin_models.py names them by attribute).
mistral = partial(build_tiny_arch, arch="mistral")
gemma2 = partial(build_tiny_arch, arch="gemma2")
gemma3 = partial(build_tiny_arch, arch="gemma3")
phi3 = partial(build_tiny_arch, arch="phi3")
qwen3_moe = partial(build_tiny_arch, arch="qwen3-moe")
mixtral = partial(build_tiny_arch, arch="mixtral")
gpt_oss = partial(build_tiny_arch, arch="gpt-oss")
