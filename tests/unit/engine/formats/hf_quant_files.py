"""Quantized Hugging Face checkpoints of a tiny Llama (builtin:tiny-mistral: Llama's layers with
Mistral's config), for the readers' tests, each with its reference float32 weights.

compressed-tensors: written and dequantized by the `compressed-tensors` package itself (its
compressors on a float state dict; its decompress, given the stored scales widened to float32,
computes scale * (q - zero) exactly). GPTQ / AWQ: no package here writes them (gptqmodel and
autoawq need CUDA builds), so this module packs them and dequantizes them element by element,
word by word, from the formats' published descriptions, sharing no code with the engine's
readers: plain Python integers, one shift and mask per value.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

LINEAR = re.compile(r"\.(q|k|v|o|gate|up|down)_proj\.weight$")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's GEMM packing: field i holds column order[i]


@dataclass
class Quantized:
    """A checkpoint's tensors, its quantization_config, and each linear's float32 weight as
    the format's reference dequantizes it."""

    tensors: dict[str, torch.Tensor]
    qconfig: dict[str, Any]
    reference: dict[str, torch.Tensor]


def source_state(source: Path) -> dict[str, torch.Tensor]:
    return load_file(source / "model.safetensors")


def write_checkpoint(
    source: Path, out: Path, tensors: dict[str, torch.Tensor], qconfig: dict | None = None
) -> Path:
    """`source`'s config and tokenizer beside `tensors`, with `qconfig` as quantization_config."""
    out.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.name not in ("model.safetensors", "config.json", "pdcluster-build.json"):
            shutil.copy(f, out / f.name)
    config = json.loads((source / "config.json").read_text())
    if qconfig is not None:
        config["quantization_config"] = qconfig
    (out / "config.json").write_text(json.dumps(config))
    save_file({n: t.contiguous() for n, t in tensors.items()}, out / "model.safetensors")
    return out


# --- compressed-tensors, by its own package ---


def compressed_tensors_checkpoint(
    state: dict[str, torch.Tensor],
    bits: int,
    symmetric: bool,
    strategy: str,
    group_size: int | None = None,
    fmt: str = "pack-quantized",
    dynamic_int8_activations: bool = False,
) -> Quantized:
    """Every linear layer but the LM head quantized with min-max scales from its bfloat16
    weights (llm-compressor's observer's rule), by compressed-tensors' compressor for `fmt`."""
    from compressed_tensors.compressors.naive_quantized.base import (
        IntQuantizationCompressor,
        NaiveQuantizationCompressor,
    )
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
    )
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    compressor = {
        "pack-quantized": PackedQuantizationCompressor,
        "naive-quantized": NaiveQuantizationCompressor,
        "int-quantized": IntQuantizationCompressor,
    }[fmt]
    args = QuantizationArgs(
        num_bits=bits, symmetric=symmetric, strategy=strategy, group_size=group_size
    )
    inputs = (
        QuantizationArgs(num_bits=8, symmetric=True, strategy="token", dynamic=True)
        if dynamic_int8_activations
        else None
    )
    scheme = QuantizationScheme(targets=["Linear"], weights=args, input_activations=inputs)
    tensors, reference = {}, {}
    for name, weight in state.items():
        if not LINEAR.search(name):
            tensors[name] = weight
            continue
        module = name.removesuffix(".weight")
        w = weight.to(torch.bfloat16)
        n, k = w.shape
        groups = {"group": k // (group_size or k), "channel": 1}.get(strategy)
        spans = w.reshape(1, 1, -1) if groups is None else w.reshape(n, groups, -1)
        scale, zero = calculate_qparams(spans.amin(-1), spans.amax(-1), args)
        if groups is None:
            scale, zero = scale.reshape(1), zero.reshape(1)
        compressed = compressor.compress(
            {"weight": w, "weight_scale": scale, "weight_zero_point": zero}, scheme
        )
        tensors.update({f"{module}.{part}": t for part, t in compressed.items()})
        widened = {**compressed, "weight_scale": compressed["weight_scale"].float()}
        reference[name] = compressor.decompress(widened, scheme)["weight"]
        assert reference[name].dtype == torch.float32
    qconfig = QuantizationConfig(
        config_groups={"group_0": scheme},
        format=fmt,
        ignore=["lm_head"],
        quantization_status="compressed",
    ).model_dump(exclude=["quant_method"])
    qconfig["quant_method"] = "compressed-tensors"  # as ModelCompressor.update_config writes it
    return Quantized(tensors, qconfig, reference)


def decompress_in_stored_dtype(quantized: Quantized, module: str) -> torch.Tensor:
    """compressed-tensors' decompression of `module` as stored: computed in its scales' dtype."""
    from compressed_tensors.compressors.naive_quantized.base import NaiveQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    group = quantized.qconfig["config_groups"]["group_0"]
    scheme = QuantizationScheme.model_validate(group)
    parts = {
        n.removeprefix(f"{module}."): t
        for n, t in quantized.tensors.items()
        if n.startswith(f"{module}.weight")
    }
    packed = "weight_packed" in parts
    compressor = PackedQuantizationCompressor if packed else NaiveQuantizationCompressor
    return compressor.decompress(parts, scheme)["weight"]


# --- GPTQ and AWQ, packed and dequantized here from the formats' descriptions ---


def round_to_nearest(
    weight: torch.Tensor, bits: int, group_size: int, symmetric: bool
) -> tuple[list[list[int]], list[list[int]], torch.Tensor]:
    """(q (N, K), zeros (N, groups), float16 scales (N, groups)): min-max round-to-nearest,
    unsigned q in [0, 2 ** bits) as GPTQ and AWQ store it; symmetric: zero 2 ** (bits - 1)."""
    n, k = weight.shape
    top = (1 << bits) - 1
    spans = weight.reshape(n, k // group_size, group_size)
    if symmetric:
        scales = (spans.abs().amax(-1) / (top // 2)).half().clamp(min=1e-4)
        zeros = torch.full(scales.shape, float(1 << (bits - 1)))
    else:
        low, high = spans.amin(-1).clamp(max=0), spans.amax(-1).clamp(min=0)
        scales = ((high - low) / top).half().clamp(min=1e-4)
        zeros = (-low / scales.float()).round().clamp(0, top)
    q = (spans / scales.float().unsqueeze(-1)).round() + zeros.unsqueeze(-1)
    q = q.clamp(0, top).reshape(n, k)
    return q.int().tolist(), zeros.int().tolist(), scales


def _int32(words: list[list[int]]) -> torch.Tensor:
    """Unsigned 32-bit words as the int32 tensor a checkpoint stores."""
    return torch.tensor([[w - (1 << 32) if w >= 1 << 31 else w for w in row] for row in words],
                        dtype=torch.int32)  # fmt: skip


def _unsigned(t: torch.Tensor) -> list[list[int]]:
    return [[w & 0xFFFFFFFF for w in row] for row in t.tolist()]


def pack_gptq(
    q: list[list[int]], zeros: list[list[int]], scales: torch.Tensor, bits: int, v1: bool
) -> dict[str, torch.Tensor]:
    """GPTQ's tensors: qweight (K * bits / 32, N), a word holding 32 // bits consecutive input
    channels of one column, lowest bits first; qzeros (groups, N * bits / 32) along N, each zero
    minus one in v1 (AutoGPTQ's format); scales (groups, N); g_idx k // group_size."""
    n, k, groups = len(q), len(q[0]), len(zeros[0])
    per, mask = 32 // bits, (1 << bits) - 1
    qweight = [[0] * n for _ in range(k // per)]
    for col in range(n):
        for row in range(k):
            qweight[row // per][col] |= q[col][row] << (bits * (row % per))
    qzeros = [[0] * -(-n // per) for _ in range(groups)]
    for col in range(n):
        for g in range(groups):
            stored = (zeros[col][g] - 1 if v1 else zeros[col][g]) & mask
            qzeros[g][col // per] |= stored << (bits * (col % per))
    g_idx = torch.arange(k, dtype=torch.int32) // (k // groups)
    return {"qweight": _int32(qweight), "qzeros": _int32(qzeros), "scales": scales.T.contiguous(),
            "g_idx": g_idx}  # fmt: skip


def gptq_reference(parts: dict[str, torch.Tensor], bits: int, v1: bool) -> torch.Tensor:
    """w[n][k] = scale[g][n] * (q - zero), each q and zero shifted out of its word."""
    qweight, qzeros = _unsigned(parts["qweight"]), _unsigned(parts["qzeros"])
    scales, g_idx = parts["scales"].float().tolist(), parts["g_idx"].tolist()
    per, mask = 32 // bits, (1 << bits) - 1
    n, k = len(qweight[0]), len(qweight) * per
    weight = [[0.0] * k for _ in range(n)]
    for col in range(n):
        for row in range(k):
            q = (qweight[row // per][col] >> (bits * (row % per))) & mask
            g = g_idx[row]
            zero = (qzeros[g][col // per] >> (bits * (col % per))) & mask
            weight[col][row] = scales[g][col] * (q - (zero + 1 if v1 else zero))
    return torch.tensor(weight, dtype=torch.float32)  # exact: float16 times a small integer


def pack_awq(
    q: list[list[int]], zeros: list[list[int]], scales: torch.Tensor
) -> dict[str, torch.Tensor]:
    """AWQ's GEMM tensors: qweight (K, N / 8) and qzeros (groups, N / 8), each word 8 columns
    with column 8j + AWQ_ORDER[i] in bits 4i..4i+3; scales (groups, N)."""
    n, k, groups = len(q), len(q[0]), len(zeros[0])

    def pack(values: list[list[int]]) -> list[list[int]]:  # values (rows, N)
        return [[sum(row[8 * j + AWQ_ORDER[i]] << (4 * i) for i in range(8))
                 for j in range(n // 8)] for row in values]  # fmt: skip

    q_by_row = [[q[col][row] for col in range(n)] for row in range(k)]
    zeros_by_group = [[zeros[col][g] for col in range(n)] for g in range(groups)]
    return {"qweight": _int32(pack(q_by_row)), "qzeros": _int32(pack(zeros_by_group)),
            "scales": scales.T.contiguous()}  # fmt: skip


def awq_reference(parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """w[n][k] = scale[g][n] * (q - zero), column n at field AWQ_ORDER.index(n % 8)."""
    qweight, qzeros = _unsigned(parts["qweight"]), _unsigned(parts["qzeros"])
    scales = parts["scales"].float().tolist()
    k, n, groups = len(qweight), len(qweight[0]) * 8, len(qzeros)
    weight = [[0.0] * k for _ in range(n)]
    for col in range(n):
        shift = 4 * AWQ_ORDER.index(col % 8)
        for row in range(k):
            g = row // (k // groups)
            q = (qweight[row][col // 8] >> shift) & 15
            zero = (qzeros[g][col // 8] >> shift) & 15
            weight[col][row] = scales[g][col] * (q - zero)
    return torch.tensor(weight, dtype=torch.float32)


def gptq_like_checkpoint(
    state: dict[str, torch.Tensor],
    method: str,
    bits: int = 4,
    group_size: int = 32,
    symmetric: bool = True,
    v1: bool = True,
) -> Quantized:
    """Every linear layer but the LM head packed as GPTQ (`v1`: AutoGPTQ's zeros minus one) or
    AWQ's GEMM, group_size -1 meaning one group of K (GPTQ's per-channel)."""
    tensors, reference = {}, {}
    for name, weight in state.items():
        if not LINEAR.search(name):
            tensors[name] = weight
            continue
        module = name.removesuffix(".weight")
        group = weight.shape[1] if group_size == -1 else group_size
        q, zeros, scales = round_to_nearest(weight, bits, group, symmetric)
        if method == "awq":
            parts = pack_awq(q, zeros, scales)
            reference[name] = awq_reference(parts)
        else:
            parts = pack_gptq(q, zeros, scales, bits, v1)
            reference[name] = gptq_reference(parts, bits, v1)
        tensors.update({f"{module}.{part}": t for part, t in parts.items()})
    if method == "awq":
        qconfig = {"quant_method": "awq", "bits": 4, "group_size": group_size,
                   "zero_point": True, "version": "gemm"}  # fmt: skip
    else:
        qconfig = {"quant_method": "gptq", "bits": bits, "group_size": group_size,
                   "desc_act": False, "sym": symmetric, "damp_percent": 0.01,
                   "true_sequential": True, "static_groups": False,
                   "checkpoint_format": "gptq" if v1 else "gptq_v2"}  # fmt: skip
    return Quantized(tensors, qconfig, reference)
