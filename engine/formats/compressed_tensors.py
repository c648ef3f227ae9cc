"""compressed-tensors checkpoints (llm-compressor's, `quant_method: compressed-tensors`) with
int4 / int8 weights, read into QuantizedWeights without loss.

What the files hold, per quantized linear layer `m` (compressed_tensors.compressors):
- pack-quantized: `m.weight_packed` int32 (N, ceil(K * bits / 32)): each word holds 32 // bits
  consecutive K values, lowest bits first, each stored as q + 2 ** (bits - 1) for q signed in
  [-2 ** (bits - 1), 2 ** (bits - 1)); `m.weight_shape` (N, K); `m.weight_scale` (N, groups);
  asymmetric schemes add `m.weight_zero_point`, signed like q and packed the same way along N
  (int32 (ceil(N * bits / 32), groups); files from before that packing keep it int8 (N, groups)).
- int-quantized / naive-quantized: `m.weight` int8 (N, K) holding q itself, the same scales and
  zero points unpacked.
- w = scale * (q - zero). Groups are the scheme's strategy: `group` (group_size along K),
  `channel` (one group of K per row), `tensor` (one scale for the matrix).

A scheme quantizing activations too (w8a8's dynamic int8 tokens) is read for its weights: the
engine computes activations as it always does. What changes the weights' meaning beyond this
(float or block-scaled types, transforms, sparsity, a quantized KV cache, static activation
scales, act-order groups other than the plain ones) is refused in one line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
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

FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")
STRATEGIES = ("group", "channel", "tensor")
PACKED_PARTS = ("weight_packed", "weight_shape", "weight_scale", "weight_zero_point",
                "weight_g_idx")  # fmt: skip
NAIVE_PARTS = ("weight", "weight_scale", "weight_zero_point", "weight_g_idx")


@dataclass(frozen=True, slots=True)
class WeightScheme:
    """One config group's weights, as read from quantization_config.config_groups."""

    targets: tuple[str, ...]  # module names, "re:" patterns, or class names ("Linear")
    num_bits: int
    symmetric: bool
    strategy: str
    group_size: int | None
    format: str


def check_config(qconfig: dict[str, Any]) -> None:
    weight_schemes(qconfig)


def weight_schemes(qconfig: dict[str, Any]) -> list[WeightScheme]:
    """The config groups, each checked to be one this reader converts without loss."""
    if qconfig.get("kv_cache_scheme"):
        raise ValueError("a quantized KV cache (kv_cache_scheme) is not supported")
    if qconfig.get("transform_config"):
        raise ValueError("transforms (transform_config: rotations) are not supported")
    sparsity = qconfig.get("sparsity_config") or {}
    if sparsity.get("format", "dense") != "dense":
        raise ValueError(f"sparse checkpoints ({sparsity['format']}) are not supported")
    groups = qconfig.get("config_groups") or {}
    if not groups:
        raise ValueError("no config_groups")
    return [_scheme(name, group, qconfig.get("format")) for name, group in groups.items()]


def _scheme(name: str, group: dict[str, Any], top_format: str | None) -> WeightScheme:
    weights = group.get("weights")
    fmt = group.get("format") or top_format
    if not weights:
        raise ValueError(f"{name}: no weight quantization (activations only)")
    if fmt not in FORMATS:
        raise ValueError(f"{name}: format {fmt!r} is not supported ({', '.join(FORMATS)})")
    kind, bits = weights.get("type", "int"), weights.get("num_bits")
    if kind != "int" or bits not in (4, 8):
        raise ValueError(f"{name}: {kind}{bits} weights are not supported (int4 or int8)")
    strategy, group_size = weights.get("strategy"), weights.get("group_size")
    if strategy not in STRATEGIES or (strategy == "group" and not group_size):
        raise ValueError(f"{name}: weight strategy {strategy!r} is not supported (group, "
                         "channel, tensor)")  # fmt: skip
    if weights.get("dynamic"):
        raise ValueError(f"{name}: dynamic weight scales are not supported")
    inputs = group.get("input_activations")
    if inputs and (inputs.get("type", "int") != "int" or not inputs.get("dynamic")):
        raise ValueError(f"{name}: static or float activation quantization is not supported "
                         "(weight-only, or dynamic int8 activations)")  # fmt: skip
    if group.get("output_activations"):
        raise ValueError(f"{name}: output activation quantization is not supported")
    return WeightScheme(
        targets=tuple(group.get("targets") or ()),
        num_bits=int(bits),
        symmetric=bool(weights.get("symmetric", True)),
        strategy=str(strategy),
        group_size=group_size,
        format=str(fmt),
    )


def scheme_for(module: str, schemes: list[WeightScheme]) -> WeightScheme:
    """The config group that quantized `module`: one naming it, else one whose regex matches
    it, else one targeting every Linear (every tensor read here is a linear layer's)."""
    named = [s for s in schemes if module in s.targets]
    matched = [
        s
        for s in schemes
        if any(t.startswith("re:") and re.match(t[3:], module) for t in s.targets)
    ]
    linear = [s for s in schemes if "Linear" in s.targets]
    for found in (named, matched, linear):
        if found:
            return found[0]
    raise ValueError(f"{module}: quantized in the checkpoint, but no config group targets it")


def read_quantized(model_dir: Path, config: dict[str, Any], dtype: torch.dtype) -> State:
    """The checkpoint's tensors, each quantized linear layer's as one QuantizedWeight."""
    schemes = weight_schemes(config["quantization_config"])
    stored = read_stored(model_dir)
    state: State = {}
    for module, parts in take_modules(stored, "weight_packed", PACKED_PARTS).items():
        state[f"{module}.weight"] = _packed(module, parts, scheme_for(module, schemes))
    naive = [n.removesuffix(".weight_scale") for n in stored if n.endswith(".weight_scale")]
    for module in naive:
        parts = {p: stored.pop(f"{module}.{p}") for p in NAIVE_PARTS if f"{module}.{p}" in stored}
        state[f"{module}.weight"] = _naive(module, parts, scheme_for(module, schemes))
    state.update(float_rest(stored, dtype))
    return state


def _packed(module: str, parts: dict[str, torch.Tensor], scheme: WeightScheme) -> QuantizedWeight:
    bits = scheme.num_bits
    offset = 1 << (bits - 1)
    n, k = (int(x) for x in parts["weight_shape"].tolist())
    packed = parts["weight_packed"]
    if tuple(packed.shape) != (n, -(-k * bits // 32)):
        raise ValueError(f"{module}: weight_packed {tuple(packed.shape)} for a ({n}, {k}) "
                         f"{bits}-bit matrix")  # fmt: skip
    q = unpack_int32(packed, bits)[:, :k] - offset  # (N, K) signed
    scales = _per_row(parts["weight_scale"], n)
    zeros = parts.get("weight_zero_point")
    if zeros is not None and zeros.dtype == torch.int32:  # packed along N: (ceil(N * bits / 32), G)
        zeros = unpack_int32(zeros.T.contiguous(), bits)[:, :n].T - offset
    return _convert(module, scheme, q, scales, zeros, parts.get("weight_g_idx"))


def _naive(module: str, parts: dict[str, torch.Tensor], scheme: WeightScheme) -> QuantizedWeight:
    q = parts["weight"]
    if q.is_floating_point():
        raise ValueError(f"{module}: weight_scale beside a {q.dtype} weight (not quantized)")
    scales = _per_row(parts["weight_scale"], q.shape[0])
    zeros = parts.get("weight_zero_point")
    return _convert(module, scheme, q.to(torch.int32), scales, zeros, parts.get("weight_g_idx"))


def _per_row(scales: torch.Tensor, n: int) -> torch.Tensor:
    """(N, groups) scales: a `tensor` strategy's single scale repeated on every row."""
    if scales.numel() == 1:
        return scales.reshape(1, 1).expand(n, 1).contiguous()
    return scales.reshape(n, -1) if scales.dim() == 1 else scales


def _convert(
    module: str,
    scheme: WeightScheme,
    q: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    g_idx: torch.Tensor | None,
) -> QuantizedWeight:
    n, k = q.shape
    if scheme.strategy == "group" and scales.shape[-1] * (scheme.group_size or 0) != k:
        raise ValueError(f"{module}: scales {tuple(scales.shape)} are not groups of "
                         f"{scheme.group_size} of K={k}")  # fmt: skip
    if zeros is not None:  # (N, groups) as the scales, or the `tensor` strategy's one zero
        zeros = zeros.reshape(1, 1) if zeros.numel() == 1 else zeros.reshape(n, -1)
        zeros = zeros.expand_as(scales)
    if not identity_groups(g_idx, k, k // scales.shape[-1]):
        raise ValueError(f"{module}: act-order groups (weight_g_idx) other than consecutive "
                         "columns are not supported")  # fmt: skip
    bits = scheme.num_bits
    return to_quantized(module, bits, q, scales, zeros, q_min=-(1 << (bits - 1)))
