"""engine/formats/gguf_write.py: a Q8_0 copy keeps its source's metadata and tensor list, holds
gguf's own Q8_0 of the checkpoint (q / k in llama.cpp's row order), and reads back; an F32 copy
reads back as the checkpoint itself."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGUFReader, LlamaFileType
from safetensors.numpy import save_file

from engine.formats.gguf import load_gguf, read_config
from engine.formats.gguf_write import write_f32, write_q8_0
from engine.quant.weight import QuantizedWeight
from engine.smollm2_model import gguf_path
from tests.unit.engine.formats.gguf_files import (
    Q,
    llama_cpp_permute,
    llama_hf_state,
    llama_metadata,
    write_gguf,
)

GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    if hf_name in GGUF_NAMES:
        return GGUF_NAMES[hf_name]
    _, _, layer, *module, suffix = hf_name.split(".")
    return f"blk.{layer}.{GGUF_NAMES['.'.join(module)]}.{suffix}"


def q8_0(weight: np.ndarray) -> np.ndarray:
    """gguf's Q8_0 of `weight`, dequantized by gguf."""
    return gguf.quants.dequantize(gguf.quants.quantize(weight, Q.Q8_0), Q.Q8_0)


def stored_as_llama_cpp(name: str, weight: np.ndarray) -> np.ndarray:
    heads = {"attn_q": 4, "attn_k": 2}.get(gguf_name(name).split(".")[-2])
    return weight if heads is None else llama_cpp_permute(weight, heads)


@pytest.fixture
def q4_0_source(tmp_path: Path) -> tuple[Path, Path, dict[str, np.ndarray]]:
    """A small Llama GGUF in Q4_0 (tokenizer, chat template) and its float32 checkpoint."""
    state = llama_hf_state()
    tensors = {}
    for name, weight in state.items():
        stored = stored_as_llama_cpp(name, weight)
        q4 = (gguf.quants.quantize(stored, Q.Q4_0), Q.Q4_0) if weight.ndim == 2 else None
        tensors[gguf_name(name)] = q4 or (weight, None)
    metadata = llama_metadata(**{"tokenizer.chat_template": "{{ messages }}"})
    source = write_gguf(tmp_path / "source.gguf", "llama", metadata, tensors)
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    save_file(state, str(checkpoint / "model.safetensors"))
    return source, checkpoint, state


def test_the_q8_0_copy_keeps_the_metadata_and_holds_ggufs_q8_0(
    q4_0_source: tuple[Path, Path, dict[str, np.ndarray]], tmp_path: Path
) -> None:
    source, checkpoint, state = q4_0_source
    out = write_q8_0(source, checkpoint, tmp_path / "q8.gguf")
    before, after = GGUFReader(source), GGUFReader(out)
    assert after.fields["general.file_type"].contents() == LlamaFileType.MOSTLY_Q8_0
    own = ("GGUF.kv_count", "general.file_type")  # the source had no file type
    kept = {k: f.contents() for k, f in before.fields.items() if k not in own}
    assert kept == {k: f.contents() for k, f in after.fields.items() if k not in own}
    assert [t.name for t in after.tensors] == [t.name for t in before.tensors]
    for tensor in after.tensors:  # as stored: q / k rows in llama.cpp's order
        name = next(n for n in state if gguf_name(n) == tensor.name)
        expected = stored_as_llama_cpp(name, state[name])
        if expected.ndim == 2:
            assert tensor.tensor_type == Q.Q8_0
            expected = q8_0(expected)
        assert np.array_equal(gguf.quants.dequantize(tensor.data, tensor.tensor_type), expected)
    assert read_config(out) == read_config(source)
    for name, weight in load_gguf(out).tensors.items():  # and read back in HF order
        if isinstance(weight, QuantizedWeight):
            assert (weight.bits, weight.group_size) == (8, 32)
            weight = weight.dequantize()
        reference = q8_0(state[name]) if state[name].ndim == 2 else state[name]
        assert torch.equal(weight, torch.from_numpy(reference)), name


def test_the_f32_copy_reads_back_as_the_checkpoint(
    q4_0_source: tuple[Path, Path, dict[str, np.ndarray]], tmp_path: Path
) -> None:
    source, checkpoint, state = q4_0_source
    out = write_f32(source, checkpoint, tmp_path / "f32.gguf")
    reader = GGUFReader(out)
    assert reader.fields["general.file_type"].contents() == LlamaFileType.ALL_F32
    assert {t.tensor_type for t in reader.tensors} == {Q.F32}
    assert read_config(out) == read_config(source)
    tensors = load_gguf(out).tensors
    assert tensors.keys() == state.keys()
    for name, weight in tensors.items():
        assert torch.equal(weight, torch.from_numpy(state[name])), name


@pytest.mark.long  # about 15 s: quantizes and writes SmolLM2's 135M weights (138 MB)
def test_smollm2_q8_0_reads_back_within_q8_0s_rounding(smollm2_path: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    out = write_q8_0(gguf_path(), smollm2_path, tmp_path / "smollm2-q8_0.gguf")
    checkpoint = load_gguf(out)
    assert checkpoint.config == read_config(gguf_path())
    reference = load_file(smollm2_path / "model.safetensors")
    assert checkpoint.tensors.keys() == reference.keys()
    for name, weight in checkpoint.tensors.items():
        if not isinstance(weight, QuantizedWeight):
            assert torch.equal(weight, reference[name]), name
            continue
        assert weight.bits == 8 and weight.group_size == 32
        # Q8_0 rounds x / d to the nearest integer q (|q| <= 127) with d = amax / 127, then
        # stores d as float16 (relative error <= 2^-11): |x - q d16| <= d / 2 + 127 d 2^-11
        bound = (0.5 + 127 / 2048) * weight.scales.abs().unsqueeze(-1)
        error = (weight.dequantize() - reference[name]).abs().reshape(*weight.scales.shape, 32)
        assert bool((error <= bound).all()), name
