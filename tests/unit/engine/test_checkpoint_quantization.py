"""cluster.yaml `quantization` (as vLLM's --quantization): auto reads what the checkpoint holds, a
format's name must be what it holds, dequantize serves its matrices as float tensors."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from engine.config import EngineConfig
from engine.models.checkpoint import checkpoint_format, read_checkpoint
from engine.quant.weight import QuantizedWeight
from tests.unit.engine.formats.gguf_files import Q, llama_hf_state, llama_metadata, write_gguf
from tests.unit.engine.formats.test_gguf_write import gguf_name, stored_as_llama_cpp


@pytest.fixture
def q8_0_dir(tmp_path: Path) -> Path:
    """A small Llama GGUF: its matrices Q8_0, its norms float32."""
    tensors = {}
    for name, weight in llama_hf_state().items():
        stored = stored_as_llama_cpp(name, weight)
        q8 = (gguf.quants.quantize(stored, Q.Q8_0), Q.Q8_0) if weight.ndim == 2 else None
        tensors[gguf_name(name)] = q8 or (weight, None)
    write_gguf(tmp_path / "model.gguf", "llama", llama_metadata(), tensors)
    return tmp_path


def test_auto_and_the_formats_name_keep_the_matrices_quantized(q8_0_dir: Path) -> None:
    assert checkpoint_format(q8_0_dir) == "gguf"
    for quantization in ("auto", "gguf"):
        state = read_checkpoint(q8_0_dir, torch.float32, quantization)
        weight = state["model.layers.0.mlp.down_proj.weight"]
        assert isinstance(weight, QuantizedWeight) and weight.bits == 8
        assert state["model.norm.weight"].dtype == torch.float32  # type: ignore[union-attr]


def test_dequantize_serves_the_same_values_as_float_tensors(q8_0_dir: Path) -> None:
    kept = read_checkpoint(q8_0_dir, torch.float32)
    floats = read_checkpoint(q8_0_dir, torch.bfloat16, "dequantize")
    assert kept.keys() == floats.keys()
    for name, tensor in floats.items():
        assert isinstance(tensor, torch.Tensor) and tensor.dtype == torch.bfloat16
        stored = kept[name]
        expected = stored.dequantize() if isinstance(stored, QuantizedWeight) else stored
        assert torch.equal(tensor, expected.to(torch.bfloat16))


def test_another_formats_name_is_refused_naming_both(q8_0_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"quantization: gptq, but .* holds gguf weights"):
        read_checkpoint(q8_0_dir, torch.float32, "gptq")
    plain = tmp_path / "plain"
    plain.mkdir()
    save_file({"w": np.zeros((2, 2), np.float32)}, str(plain / "model.safetensors"))
    assert checkpoint_format(plain) is None
    with pytest.raises(ValueError, match="holds unquantized safetensors"):
        read_checkpoint(plain, torch.float32, "awq")


def test_an_unknown_quantization_is_refused_by_the_engine_config() -> None:
    with pytest.raises(ValueError, match="quantization must be one of auto, gguf"):
        EngineConfig(model="builtin:tiny", quantization="bitsandbytes")
