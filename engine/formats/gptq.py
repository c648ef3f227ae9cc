"""GPTQ (`quant_method: gptq`) and AWQ (`quant_method: awq`, GEMM packing) checkpoints, read
into QuantizedWeights without loss. Both store, per quantized linear layer `m`, unsigned
integers packed 32 // bits to an int32 word (lowest bits first), float16 scales and packed
zero points, with w = scale * (q - zero); they differ in which axis a word runs along and in
what order its fields come.

GPTQ (AutoGPTQ / GPTQModel, transformers' and optimum's GPTQ):
- `m.qweight` int32 (K * bits / 32, N): a word holds 32 // bits consecutive input channels
  (K) of one output column.
- `m.qzeros` int32 (groups, N * bits / 32): a word holds consecutive output columns' zeros.
- `m.scales` float16 (groups, N); `m.g_idx` int32 (K,): each input channel's group.
- checkpoint_format "gptq" (v1, AutoGPTQ's, the default) stores each zero minus one (zero =
  stored + 1, as its kernels add it back); "gptq_v2" stores the zero itself.
- desc_act (act-order): input channels quantized in a permuted order, g_idx then maps channel
  k to its group. Read only where g_idx is still the plain k // group_size (a QuantizedWeight's
  groups are consecutive columns; permuted ones would need activations permuted per matmul).

AWQ (AutoAWQ's GEMM version, 4 bits):
- `m.qweight` int32 (K, N / 8) and `m.qzeros` int32 (groups, N / 8): a word holds 8 output
  columns, column order[i] in field i with order = (0, 2, 4, 6, 1, 3, 5, 7).
- `m.scales` float16 (groups, N); zero points as stored (no offset).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine.formats.hf_quant import (
    State,
    float_rest,
    identity_groups,
    read_stored,
    take_modules,
    to_quantized,
    unpack_int32,
)
from engine.quant.weight import QuantizedWeight

GPTQ_FORMATS = ("gptq", "gptq_v2")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # field i of a word holds column AWQ_ORDER[i] of its 8
AWQ_FIELD = tuple(AWQ_ORDER.index(c) for c in range(8))  # column c is in field AWQ_FIELD[c]
PARTS = ("qweight", "qzeros", "scales", "g_idx")


def check_config(qconfig: dict[str, Any]) -> None:
    if qconfig["quant_method"] == "awq":
        _awq_bits(qconfig)
    else:
        _gptq_format(qconfig)


def _gptq_format(qconfig: dict[str, Any]) -> tuple[int, bool]:
    """(bits, whether zeros are stored minus one): GPTQ's v1 format or v2."""
    bits = qconfig.get("bits")
    if bits not in (4, 8):
        raise ValueError(f"{bits}-bit weights are not supported (4 or 8)")
    fmt = qconfig.get("checkpoint_format") or qconfig.get("format") or "gptq"
    if fmt not in GPTQ_FORMATS:
        raise ValueError(f"checkpoint_format {fmt!r} is not supported ({', '.join(GPTQ_FORMATS)})")
    if qconfig.get("dynamic"):
        raise ValueError("per-module overrides (dynamic) are not supported")
    return int(bits), fmt == "gptq"


def _awq_bits(qconfig: dict[str, Any]) -> int:
    bits = qconfig.get("bits", qconfig.get("w_bit"))
    if bits != 4:
        raise ValueError(f"{bits}-bit weights are not supported (4)")
    version = str(qconfig.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"version {version!r} is not supported (gemm: AutoAWQ's default)")
    if not qconfig.get("zero_point", True):
        raise ValueError("weights without zero points (zero_point: false) are not supported")
    return 4


def read_quantized(model_dir: Path, config: dict[str, Any], dtype: torch.dtype) -> State:
    """The checkpoint's tensors, each quantized linear layer's as one QuantizedWeight."""
    qconfig = config["quantization_config"]
    awq = qconfig["quant_method"] == "awq"
    stored = read_stored(model_dir)
    state: State = {}
    for module, parts in take_modules(stored, "qweight", PARTS).items():
        missing = [p for p in PARTS[:3] if p not in parts]
        if missing:
            raise ValueError(f"{module}: qweight without {', '.join(missing)}")
        weight = _awq(module, parts) if awq else _gptq(module, parts, *_gptq_format(qconfig))
        state[f"{module}.weight"] = weight
    state.update(float_rest(stored, dtype))
    return state


def _gptq(
    module: str, parts: dict[str, torch.Tensor], bits: int, zeros_minus_one: bool
) -> QuantizedWeight:
    qweight, scales = parts["qweight"], parts["scales"]
    k, n = qweight.shape[0] * 32 // bits, qweight.shape[1]
    groups = scales.shape[0]
    if scales.shape[1] != n or k % groups:
        raise ValueError(f"{module}: scales {tuple(scales.shape)} for a ({n}, {k}) matrix")
    q = unpack_int32(qweight.T.contiguous(), bits)  # (N, K)
    zeros = unpack_int32(parts["qzeros"], bits)[:, :n].T  # (N, groups)
    if zeros_minus_one:
        zeros = zeros + 1
    if not identity_groups(parts.get("g_idx"), k, k // groups):
        raise ValueError(f"{module}: act-order (desc_act) groups that permute input channels "
                         "(g_idx) are not supported; quantize with desc_act false")  # fmt: skip
    return to_quantized(module, bits, q, scales.T, zeros, q_min=0)


def _awq(module: str, parts: dict[str, torch.Tensor]) -> QuantizedWeight:
    qweight, scales = parts["qweight"], parts["scales"]
    k, n = qweight.shape[0], qweight.shape[1] * 8
    if scales.shape[1] != n or k % scales.shape[0]:
        raise ValueError(f"{module}: scales {tuple(scales.shape)} for a ({n}, {k}) matrix")
    q = _awq_columns(qweight).T  # (N, K)
    zeros = _awq_columns(parts["qzeros"]).T  # (N, groups)
    return to_quantized(module, 4, q, scales.T, zeros, q_min=0)


def _awq_columns(packed: torch.Tensor) -> torch.Tensor:
    """(rows, N / 8) AWQ words as (rows, N) 4-bit values in column order."""
    rows, words = packed.shape
    fields = unpack_int32(packed, 4).reshape(rows, words, 8)
    return fields[:, :, list(AWQ_FIELD)].reshape(rows, words * 8)
