"""Hugging Face checkpoints quantized weight-only, where config.json's quantization_config says
so: which methods the engine reads, the stored tensors with their integers kept, and the one
conversion every format ends in, w = scale * (q - zero) as a QuantizedWeight, without loss.

Each format's module unpacks its own int32 packing into integer matrices, scales and zero
points (compressed_tensors.py; gptq.py for GPTQ and AWQ) and hands them to `to_quantized`.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from safetensors import safe_open

from engine.quant.weight import QuantizedWeight

Stored = dict[str, torch.Tensor]
State = dict[str, torch.Tensor | QuantizedWeight]  # engine/models/checkpoint.py's

METHODS = ("compressed-tensors", "gptq", "awq")
SUPPORTED = (
    "compressed-tensors int4 / int8 weights (pack-quantized, int-quantized, naive-quantized), "
    "GPTQ int4 / int8, AWQ int4 (GEMM)"
)


def check_supported(qconfig: dict[str, Any], where: str = "") -> None:
    """One line naming what is read, for a quantization_config the engine does not read."""
    method = str(qconfig.get("quant_method", "?"))
    if method not in METHODS:
        raise ValueError(
            f"{where}quantized checkpoints ({method}) are not supported (supported: {SUPPORTED}); "
            "or serve an unquantized (float32 / bfloat16 / float16) checkpoint"
        )
    try:
        _format(method).check_config(qconfig)
    except ValueError as error:
        raise ValueError(f"{where}{method}: {error}") from None


def read_quantized(model_dir: Path, config: dict[str, Any], dtype: torch.dtype) -> State:
    """The checkpoint's tensors: its quantized linear layers as QuantizedWeights, the rest in
    `dtype`."""
    qconfig = config["quantization_config"]
    check_supported(qconfig, f"{model_dir}: ")
    try:
        state: State = _format(qconfig["quant_method"]).read_quantized(model_dir, config, dtype)
    except ValueError as error:
        raise ValueError(f"{model_dir}: {qconfig['quant_method']}: {error}") from None
    return state


def _format(method: str) -> ModuleType:
    if method == "compressed-tensors":
        from engine.formats import compressed_tensors

        return compressed_tensors
    from engine.formats import gptq

    return gptq


def read_stored(model_dir: Path) -> Stored:
    """Every tensor of the checkpoint's shards as stored (packed int32 stays int32)."""
    from engine.models.checkpoint import safetensors_files

    stored: Stored = {}
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if "rotary_emb" not in name:  # old Llama checkpoints store inv_freq
                    stored[name] = f.get_tensor(name)
    return stored


def take_modules(stored: Stored, marker: str, parts: tuple[str, ...]) -> dict[str, Stored]:
    """The modules that store `{module}.{marker}`, each with those of its `parts` it stores,
    popped from `stored`."""
    suffix = f".{marker}"
    modules = {}
    for module in [n.removesuffix(suffix) for n in stored if n.endswith(suffix)]:
        modules[module] = {
            part: stored.pop(f"{module}.{part}") for part in parts if f"{module}.{part}" in stored
        }
    return modules


def float_rest(stored: Stored, dtype: torch.dtype) -> State:
    """What is not quantized (embeddings, norms, biases, ignored layers) in the model's dtype."""
    return {n: t.to(dtype) if t.is_floating_point() else t for n, t in stored.items()}


def unpack_int32(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Each int32 along the last dimension as its 32 // bits fields, lowest bits first:
    (..., W) -> (..., W * 32 // bits) int32 in [0, 2 ** bits)."""
    if packed.dtype != torch.int32:
        raise ValueError(f"packed values are {packed.dtype}, not int32")
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    fields = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # (..., W, 32 // bits)
    return fields.reshape(*packed.shape[:-1], -1)


def identity_groups(g_idx: torch.Tensor | None, in_features: int, group_size: int) -> bool:
    """Whether a g_idx (input channel -> group) is the plain grouping: channel k in group
    k // group_size, which is what a QuantizedWeight's groups are."""
    if g_idx is None:
        return True
    plain = torch.arange(in_features) // group_size
    return g_idx.shape == plain.shape and bool((g_idx.long() == plain).all())


def to_quantized(
    name: str,
    bits: int,
    q: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    q_min: int,
) -> QuantizedWeight:
    """w = scale * (q - zero) as a QuantizedWeight: q (N, K) integers in [q_min, q_min + 2 **
    bits), scales (N, G) and zeros (N, G) integers (None: zero) per group of K // G.

    4 bits: values q - q_min (0..15), mins -scale * (zero - q_min). 8 bits: values q - zero,
    which must fit int8 (symmetric files always do). A float16 / bfloat16 scale times a 5-bit
    integer is exact in float32, and so is dequantize()'s v * scale + min: the same float32
    values as scale * (q - zero) computed in float32.
    """
    n, k = q.shape
    if scales.dim() != 2 or scales.shape[0] != n or k % scales.shape[1]:
        raise ValueError(f"{name}: scales {tuple(scales.shape)} for a ({n}, {k}) matrix")
    groups = scales.shape[1]
    if zeros is not None and tuple(zeros.shape) != (n, groups):
        raise ValueError(f"{name}: zero points {tuple(zeros.shape)} for scales {(n, groups)}")
    if bool(((q < q_min) | (q >= q_min + (1 << bits))).any()):
        raise ValueError(f"{name}: values outside {bits}-bit range")
    scales = scales.float()
    group_size = k // groups
    if bits == 4:
        zero = torch.zeros(n, groups) if zeros is None else zeros.float()
        return QuantizedWeight(
            bits=4,
            group_size=group_size,
            values=(q - q_min).to(torch.uint8),
            scales=scales,
            mins=-scales * (zero - q_min),
        )
    values = q.to(torch.int32)
    if zeros is not None:  # (N, G) repeated over each group's K // G columns
        values = values - zeros.to(torch.int32).repeat_interleave(group_size, dim=1)
    if bool(((values < -128) | (values > 127)).any()):
        raise ValueError(
            f"{name}: 8-bit weights whose zero points put q - zero outside int8, which "
            "8-bit matrices here cannot hold (symmetric 8-bit files fit)"
        )
    return QuantizedWeight(8, group_size, values.to(torch.int8), scales, None)
