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


# google/gemma-3-4b-it's config.json as published (vision_config shortened): its text_config names
# only what differs from Gemma3TextConfig's defaults
GEMMA3_4B_CONFIG = {
    "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
    "boi_token_index": 255999, "eoi_token_index": 256000, "image_token_index": 262144,
    "eos_token_id": [1, 106], "mm_tokens_per_image": 256,
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                    "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                      "model_type": "siglip_vision_model", "num_attention_heads": 16,
                      "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False},
}  # fmt: skip


def test_a_gemma3_config_leaving_fields_to_defaults_reads_as_transformers_does(
    tmp_path: Path,
) -> None:
    """The sizes, rotary bases and windows transformers' Gemma3TextConfig fills in, read the same:
    rope_scaling (linear x8) on the global layers only, the local ones at base 10k."""
    from transformers import AutoConfig

    (tmp_path / "config.json").write_text(json.dumps(GEMMA3_4B_CONFIG))
    theirs = AutoConfig.from_pretrained(tmp_path).text_config
    ours = read_model_config(tmp_path)
    assert (ours.num_heads, ours.num_kv_heads, ours.head_dim, ours.vocab_size) == (
        theirs.num_attention_heads, theirs.num_key_value_heads, theirs.head_dim, theirs.vocab_size
    )  # fmt: skip
    assert ours.max_position_embeddings == theirs.max_position_embeddings == 131_072
    assert ours.scale == theirs.query_pre_attn_scalar**-0.5
    windows = [1024 if t == "sliding_attention" else None for t in theirs.layer_types]
    assert list(ours.layer_windows) == windows and windows.count(None) == 5
    full = theirs.rope_parameters["full_attention"]
    local = theirs.rope_parameters["sliding_attention"]
    assert (ours.rope.kind, ours.rope.factor, ours.rope.theta) == (
        full["rope_type"], full["factor"], full["rope_theta"]
    )  # fmt: skip
    assert ours.local_rope is not None and (ours.local_rope.kind, ours.local_rope.theta) == (
        local["rope_type"], local["rope_theta"]
    )  # fmt: skip
    assert ours.eos_token_ids == (1, 106)


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
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    text_model = AutoModelForCausalLM.from_pretrained(source)
    model.model.language_model.load_state_dict(text_model.model.state_dict())
    model.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(source / name, tmp_path / name)
    # as the published checkpoints: text_config only where it differs from the class's defaults,
    # 4.x's keys, and linear rope scaling (which transformers applies to the global layers only)
    saved = json.loads((tmp_path / "config.json").read_text())
    defaults = Gemma3TextConfig().to_dict()
    text = {k: v for k, v in saved["text_config"].items() if defaults.get(k, object()) != v}
    text.pop("layer_types")  # the default pattern (five local, one global)
    text["rope_scaling"] = {"factor": 8.0, "rope_type": "linear"}
    saved["text_config"] = text
    (tmp_path / "config.json").write_text(json.dumps(saved))
    model = Gemma3ForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert read_model_config(tmp_path).model_type == "gemma3"
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(tmp_path)(PROMPTS[0], return_tensors="pt").input_ids
    expected = model.generate(ids, do_sample=False, max_new_tokens=MAX_NEW)[0, ids.shape[1] :]
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    (result,) = LLM(str(tmp_path), num_blocks=64).generate([PROMPTS[0]], params)
    assert result.outputs[0].token_ids == expected.tolist()


def test_mistral_s_consolidated_copy_of_the_weights_is_not_read(tmp_path: Path) -> None:
    """mistralai's repos ship consolidated.safetensors (Mistral's own tensor names) beside the
    transformers shards: with an index, only the shards it names are read; without, not it."""
    import shutil

    from safetensors.torch import load_file, save_file

    from engine.models import load_model

    source = tiny_arch_path("mistral")
    shutil.copytree(source, tmp_path, dirs_exist_ok=True)
    weights = load_file(tmp_path / "model.safetensors")
    native = {name.replace("model.", "").replace("self_attn", "attention"): t
              for name, t in weights.items()}  # fmt: skip
    save_file(native, tmp_path / "consolidated.safetensors")
    config = read_model_config(tmp_path)
    model = load_model(tmp_path, config, torch.float32)  # no "unexpected" names
    assert torch.equal(model.model.embed_tokens.weight, weights["model.embed_tokens.weight"])
    index = {"metadata": {}, "weight_map": dict.fromkeys(weights, "model.safetensors")}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    load_model(tmp_path, config, torch.float32)


@pytest.mark.long
def test_a_phi3_prompt_past_the_pretraining_length_prefilled_in_chunks_matches_transformers() -> (
    None
):
    """LongRoPE picks its long factors for a prompt longer than the pretraining length (64 here)
    from its first chunk on, as transformers, which runs the prompt in one pass, does."""
    path = tiny_arch_path("phi3")
    prompt = PROMPTS[-1]  # ~80 tokens: chunks of 24 cross 64 in the third
    (expected,) = hf_greedy_ids(path, [prompt], MAX_NEW)
    for backend in ("auto", "torch"):
        llm = LLM(str(path), num_blocks=64, max_num_batched_tokens=24, attention_backend=backend)
        (result,) = llm.generate([prompt], SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
        assert result.outputs[0].token_ids == expected, backend
