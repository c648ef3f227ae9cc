"""Each architecture the engine serves against transformers `generate`: greedy output token for
token on its tiny checkpoint (tools/tiny_arch/build.py), through the engine's fast CPU path (C
kernels) and its torch path, with prompts long enough to cross every sliding window and Phi's
pretraining length; and an architecture the engine does not serve refused in one line.

The checkpoints that train at build time (tied embeddings, gpt-oss) take 25-60 s to build on
first use and are `long`; the others build in seconds.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from common.sampling_params import SamplingParams
from engine.llm import LLM
from engine.models import read_model_config, supported_model_types
from tools.tiny_model.build import TEST_PROMPTS

MAX_NEW = 24
# Short prompts, and one of ~80 tokens: past the 16-token windows and Phi's 64 positions.
PROMPTS = [*TEST_PROMPTS[:5], " ".join(TEST_PROMPTS)]
QUICK = ["mistral", "qwen3-moe", "mixtral"]
TRAINED = ["gemma2", "gemma3", "phi3", "gpt-oss"]
ARCHES = [*QUICK, *(pytest.param(a, marks=pytest.mark.long) for a in TRAINED)]


def tiny_arch_path(arch: str) -> Path:
    from engine.builtin_build import ensure_builtin

    return ensure_builtin(f"builtin:tiny-{arch}")


def hf_greedy_ids(model_dir: Path, prompts: list[str], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, one at a time, stopping at its EOS."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    outputs = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, do_sample=False, max_new_tokens=max_new_tokens)
        outputs.append(out[0, ids.shape[1] :].tolist())
    return outputs


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_greedy_output_matches_transformers(arch: str, backend: str) -> None:
    path = tiny_arch_path(arch)
    expected = hf_greedy_ids(path, PROMPTS, MAX_NEW)
    llm = LLM(str(path), num_blocks=128, attention_backend=backend)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    results = llm.generate(PROMPTS, params)  # one continuous batch: decodes of different lengths
    for prompt, want, result in zip(PROMPTS, expected, results, strict=True):
        assert result.outputs[0].token_ids == want, (arch, backend, prompt[:40])


def test_an_unsupported_architecture_is_one_line_naming_the_supported(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bloom", "vocab_size": 8}))
    with pytest.raises(ValueError) as failure:
        read_model_config(tmp_path)
    message = str(failure.value)
    assert "\n" not in message and "'bloom' is not supported" in message
    for model_type in ("llama", "gemma2", "gpt_oss", "qwen3_moe", "phi3", "mixtral"):
        assert model_type in message
    assert set(supported_model_types()) >= {"mistral", "gemma3_text", "qwen2", "qwen3"}


def test_a_quantized_checkpoint_is_refused_in_one_line(tmp_path: Path) -> None:
    config = {"model_type": "gpt_oss", "quantization_config": {"quant_method": "mxfp4"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"quantized checkpoints \(mxfp4\) are not supported"):
        read_model_config(tmp_path)


@pytest.mark.long
def test_a_multimodal_gemma3_checkpoint_serves_its_language_model(tmp_path: Path) -> None:
    """Gemma 3's 4B-27B checkpoints are Gemma3ForConditionalGeneration (model_type gemma3, the
    text model's config under text_config, its weights under language_model.): the engine serves
    the text model, the vision tower left out, with transformers' own greedy output."""
    import shutil

    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from tools.tiny_arch.build import CONFIGS

    source = tiny_arch_path("gemma3")
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 2, "image_size": 28, "patch_size": 14}  # fmt: skip
    config = Gemma3Config(text_config=CONFIGS["gemma3"]().to_dict(), vision_config=vision,
                          mm_tokens_per_image=4, image_token_index=4095, boi_token_index=4094,
                          eoi_token_index=4093)  # fmt: skip
    model = Gemma3ForConditionalGeneration(config).eval()
    from transformers import AutoModelForCausalLM

    text_model = AutoModelForCausalLM.from_pretrained(source)
    model.model.language_model.load_state_dict(text_model.model.state_dict())
    model.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(source / name, tmp_path / name)
    assert read_model_config(tmp_path).model_type == "gemma3"
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(tmp_path)(PROMPTS[0], return_tensors="pt").input_ids
    expected = model.generate(ids, do_sample=False, max_new_tokens=MAX_NEW)[0, ids.shape[1] :]
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    (result,) = LLM(str(tmp_path), num_blocks=64).generate([PROMPTS[0]], params)
    assert result.outputs[0].token_ids == expected.tolist()
