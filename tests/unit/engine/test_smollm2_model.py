"""builtin:smollm2-135m: a plain Hugging Face checkpoint, the same bytes on every build, and its
bfloat16 build the float32 one rounded. Each build dequantizes the GGUF again (~20 s): `long`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from common.model_cache import read_record, weights_sha256
from engine.builtin_build import ensure_builtin
from engine.smollm2_model import build_smollm2

pytestmark = pytest.mark.long


def test_the_directory_is_a_plain_llama_checkpoint(smollm2_path: Path) -> None:
    config = json.loads((smollm2_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 30
    assert "quantization_config" not in config and "_name_or_path" not in config
    assert config["tie_word_embeddings"] and config["rms_norm_eps"] == 1e-5
    assert "<|im_start|>" in (smollm2_path / "chat_template.jinja").read_text()
    generation = json.loads((smollm2_path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2 and generation["do_sample"] is False  # greedy default


def test_a_rebuild_gives_the_recorded_bytes(smollm2_path: Path, tmp_path: Path) -> None:
    record = read_record(smollm2_path)
    assert record is not None
    assert weights_sha256(build_smollm2(tmp_path / "again")) == record.weights_sha256


def test_the_bfloat16_build_is_the_float32_one_rounded(smollm2_path: Path) -> None:
    bf16_dir = ensure_builtin("builtin:smollm2-135m", "bfloat16")
    assert bf16_dir != smollm2_path
    assert json.loads((bf16_dir / "config.json").read_text())["dtype"] == "bfloat16"
    full, half = (
        load_file(smollm2_path / "model.safetensors"),
        load_file(bf16_dir / "model.safetensors"),
    )
    assert full.keys() == half.keys() and "lm_head.weight" not in full
    for name, tensor in full.items():
        assert half[name].dtype == torch.bfloat16
        assert torch.equal(half[name], tensor.to(torch.bfloat16)), name
